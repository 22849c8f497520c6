"""A model named by its Hugging Face id, as `vllm serve ID` and `vllm bench serve --model ID` take it: found in the
local Hugging Face cache (never downloaded), served under the id, and a clear error naming the cache when absent."""
from __future__ import annotations

import asyncio
import http.server
import json
import shutil
import threading
from pathlib import Path

import pytest

from appliance.bench.client import probe_server
from appliance.bench.run import BenchOptions, prompt_synth
from appliance.config import EMBEDDED_MODEL_DIR, Config
from appliance.errors import ConfigError, ModelLoadError
from appliance.model_zoo import hub_cache
from appliance.model_zoo.loader import resolve_model_dir
from in_process import ready_app


def cache_model(root: Path, model_id: str, commit: str = "0123abcd", ref: str | None = "main") -> Path:
    """A snapshot of the embedded model in a hub cache laid out as the hub library writes it."""
    repo = root / f"models--{model_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for f in EMBEDDED_MODEL_DIR.iterdir():
        if f.is_file():
            (snapshot / f.name).symlink_to(f)  # the hub links snapshot files to blobs
    if ref is not None:
        (repo / "refs").mkdir()
        (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "hub"
    root.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    return root


def test_the_cache_directory_follows_the_hub_librarys_variables(monkeypatch, tmp_path):
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hub_cache.cache_root() == tmp_path / "xdg" / "huggingface" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hub_cache.cache_root() == tmp_path / "home" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "direct"))
    assert hub_cache.cache_root() == tmp_path / "direct"


def test_snapshots_by_ref_by_commit_and_alone(cache):
    by_ref = cache_model(cache, "acme/tiny", "aaaa")
    assert hub_cache.cached_snapshot("acme/tiny") == by_ref
    assert hub_cache.cached_snapshot("acme/tiny", "aaaa") == by_ref
    alone = cache_model(cache, "acme/unref", "bbbb", ref=None)
    assert hub_cache.cached_snapshot("acme/unref") == alone
    assert hub_cache.cached_snapshot("acme/absent") is None
    assert hub_cache.local_model_dir("acme/tiny") == by_ref
    assert not hub_cache.is_model_id("../etc") and not hub_cache.is_model_id("/abs/path")
    assert hub_cache.is_model_id("meta-llama/Llama-3.1-8B-Instruct")


def test_a_local_directory_wins_over_the_cache(cache, tmp_path, monkeypatch):
    cache_model(cache, "acme/tiny")
    local = tmp_path / "acme" / "tiny"
    shutil.copytree(EMBEDDED_MODEL_DIR, local)
    monkeypatch.chdir(tmp_path)
    assert hub_cache.local_model_dir("acme/tiny") == Path("acme/tiny")
    assert Config.flat(model="acme/tiny").model.served_names == ("tiny",)


def test_a_cached_model_is_served_under_its_id(cache):
    cache_model(cache, "acme/tiny")
    cfg = Config.flat(model="acme/tiny", max_model_len=256)
    assert cfg.model.served_names == ("acme/tiny",)
    with ready_app(cfg) as client:
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["acme/tiny"]
        out = client.post("/v1/completions", json={"model": "acme/tiny", "prompt": "Hello", "max_tokens": 3,
                                                   "ignore_eos": True, "temperature": 0})
        assert out.status_code == 200, out.text
        assert out.json()["usage"]["completion_tokens"] == 3


def test_an_id_not_in_the_cache_names_the_cache(cache):
    with pytest.raises(ModelLoadError) as err:
        resolve_model_dir(Config.flat(model="acme/absent").model.model_dir)
    assert "acme/absent" in str(err.value) and str(cache) in str(err.value)
    assert "downloads nothing" in str(err.value)
    with pytest.raises(ModelLoadError, match="model directory not found"):
        resolve_model_dir("./no/such/dir")


def test_revision_and_download_dir_pick_the_snapshot(cache, tmp_path, monkeypatch):
    """vLLM's --revision (a ref the cache holds, or a commit) and --download-dir (the cache to look in)."""
    main = cache_model(cache, "acme/tiny", "aaaa")
    (cache / "models--acme--tiny" / "refs" / "v2").write_text("bbbb")
    shutil.copytree(main, cache / "models--acme--tiny" / "snapshots" / "bbbb", symlinks=True)
    assert Config.flat(model="acme/tiny").model.model_dir == main
    v2 = cache / "models--acme--tiny" / "snapshots" / "bbbb"
    assert Config.flat(model="acme/tiny", revision="v2").model.model_dir == v2
    assert Config.flat(model="acme/tiny", revision="bbbb").model.model_dir == v2
    assert Config.flat(model="acme/tiny", revision="v2").model.served_names == ("acme/tiny",)
    assert hub_cache.cached_snapshot("acme/tiny", "../..") is None
    with pytest.raises(ModelLoadError) as err:
        Config.flat(model="acme/tiny", revision="v9").check()
    assert "at revision v9" in str(err.value) and "--revision v9" in str(err.value)
    elsewhere = tmp_path / "elsewhere"
    other = cache_model(elsewhere, "acme/other", "cccc")
    assert Config.flat(model="acme/other", download_dir=str(elsewhere)).model.model_dir == other
    assert not Config.flat(model="acme/other").model.model_dir.exists()
    with pytest.raises(ConfigError, match="--revision v2: .*only for a model given by its id"):
        Config.flat(model="embedded", revision="v2")


def test_bench_takes_its_tokenizer_from_the_cache_or_muxds_embedded_name(cache):
    cache_model(cache, "acme/tiny")
    url = "http://127.0.0.1:9"
    assert prompt_synth(BenchOptions(url=url, model="acme/tiny")).tokenizer is not None
    assert prompt_synth(BenchOptions(url=url, model="muxd-embedded")).tokenizer is not None
    with pytest.raises(ConfigError, match="--model acme/absent: no such model directory.*Hugging Face cache"):
        prompt_synth(BenchOptions(url=url, model="acme/absent"))
    with pytest.raises(ConfigError, match="--tokenizer acme/absent"):
        prompt_synth(BenchOptions(url=url, tokenizer="acme/absent"))


def test_bench_asks_for_its_model_where_the_server_lists_it():
    models = {"data": [{"id": "first", "max_model_len": 64}, {"id": "acme/tiny", "max_model_len": 128}]}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps(models).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}"
        assert asyncio.run(probe_server(url, prefer="acme/tiny")) == ("acme/tiny", 128)
        assert asyncio.run(probe_server(url, prefer="not-served")) == ("first", 64)
        assert asyncio.run(probe_server(url, "first", prefer="acme/tiny")) == ("first", 64)
    finally:
        server.shutdown()
        server.server_close()
