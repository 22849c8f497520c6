"""Shared fixtures: tiny random checkpoints of each supported family, built with transformers on CPU."""
from __future__ import annotations

import json
import os
import tempfile

import pytest
import torch
from hypothesis import HealthCheck, settings
from tiny_models import FAMILIES, build_tiny_checkpoint, write_tiny_tokenizer

# caches (compiled kernels, profiles `muxd profile` keeps for `muxd serve`) go to a directory of this run, never the
# user's: a test must not find a profile an earlier run left, nor leave one behind
os.environ["MUXD_CACHE_DIR"] = tempfile.mkdtemp(prefix="muxd-test-cache-")

# tiny models gain nothing from intra-op threads, and CI machines have two cores shared with the server under test;
# the servers and commands the tests start inherit the setting (their OpenMP threads, spinning on two busy cores,
# had made the schemathesis run 2.5x slower)
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")

# property tests: a quick default for CI; `--hypothesis-profile=reliability` for the reliability report
settings.register_profile("ci", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("reliability", max_examples=3000, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci")


def pytest_addoption(parser):
    parser.addoption("--serve-model", default="embedded",
                     help="model directory the server tests serve (default: the embedded model)")


@pytest.fixture(scope="session", params=sorted(FAMILIES))
def tiny_checkpoint(request, tmp_path_factory):
    """(family, directory, transformers model) for each family."""
    path = tmp_path_factory.mktemp(f"tiny-{request.param}")
    model = build_tiny_checkpoint(request.param, path)
    return request.param, path, model


@pytest.fixture(scope="session")
def llama_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    model = build_tiny_checkpoint("llama", path)
    return path, model


@pytest.fixture(scope="session")
def text_checkpoint(tmp_path_factory):
    """A tiny llama with a real byte-level BPE tokenizer and chat template (eos = <|end|>)."""
    path = tmp_path_factory.mktemp("tiny-text")
    vocab = write_tiny_tokenizer(path)
    build_tiny_checkpoint("llama", path, vocab_size=vocab)
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1}))
    return path
