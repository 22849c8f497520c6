"""`muxd serve` on the GPU with Llama-3.1-8B shapes (dummy weights): the fast path behind the HTTP API."""
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
        assert "muxd:" in httpx.get(url + "/metrics").text
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    assert "attention flashinfer, compiled True, decode graphs" in log.read_text()
