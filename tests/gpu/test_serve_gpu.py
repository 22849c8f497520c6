"""`muxd serve` on the GPU with Llama-3.1-8B shapes (dummy weights): the fast path behind the HTTP API, beam search
too."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from appliance.bench.launcher import wait_until_ready

MODEL = Path(__file__).resolve().parents[2] / "configs" / "models" / "llama-3.1-8b"


def test_serve_dummy_llama_8b_answers_concurrent_token_id_prompts(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path / "server.log"
    proc = subprocess.Popen([sys.executable, "-m", "appliance", "serve", "--model", str(MODEL), "--load-format",
                             "dummy", "--max-num-seqs", "32", "--port", str(port)],
                            stdout=log.open("w"), stderr=subprocess.STDOUT, env=dict(os.environ))
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_ready(url, proc, 300, log.read_text)

        def complete(i: int) -> dict:
            body = {"model": "llama-3.1-8b", "prompt": [128000] + [1000 + i + j for j in range(20 * (i + 1))],
                    "max_tokens": 16, "ignore_eos": True, "temperature": 0.7, "seed": i}
            return httpx.post(url + "/v1/completions", json=body, timeout=120).json()

        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(complete, range(8)))
        assert all(a["usage"]["completion_tokens"] == 16 for a in answers), answers
        # beam search (one-token requests with logprobs, through the overlapped loop and the decode graphs)
        body = {"model": "llama-3.1-8b", "prompt": [128000, 1000, 1001, 1002], "max_tokens": 8, "ignore_eos": True,
                "return_token_ids": True}
        greedy = httpx.post(url + "/v1/completions", json={**body, "temperature": 0}, timeout=120).json()
        one = httpx.post(url + "/v1/completions", json={**body, "use_beam_search": True}, timeout=300).json()
        beams = httpx.post(url + "/v1/completions", json={**body, "use_beam_search": True, "n": 4, "logprobs": 1},
                           timeout=300).json()
        # (the first token comes from a prefill of the same prompt in both; later ones from decode steps against
        # prefills of the beam, whose rounding may differ where two logits nearly tie)
        assert one["choices"][0]["token_ids"][0] == greedy["choices"][0]["token_ids"][0]
        assert len({tuple(c["token_ids"]) for c in beams["choices"]}) == 4, beams
        assert all(len(c["token_ids"]) == 8 and c["finish_reason"] == "length" for c in beams["choices"])
        sums = [sum(c["logprobs"]["token_logprobs"]) for c in beams["choices"]]
        assert sums == sorted(sums, reverse=True)
        assert "muxd:" in httpx.get(url + "/metrics").text
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    assert "attention flashinfer, compiled True, decode graphs" in log.read_text()
