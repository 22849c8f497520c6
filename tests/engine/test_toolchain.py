"""compile_unavailable_reason: None where torch.compile has its toolchain, one clear sentence where it has not
(frozen binary, no compiler, compiler named by CC/CXX missing, no Python headers, no triton for CUDA)."""
from __future__ import annotations

import shutil
import stat
import sys
import sysconfig

import pytest

from appliance.engine import toolchain
from appliance.engine.toolchain import compile_unavailable_reason


@pytest.fixture
def bare_path(tmp_path, monkeypatch):
    """A PATH with nothing on it, and no CC/CXX."""
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.delenv("CXX", raising=False)
    return empty


def fake_compiler(directory, name):
    path = directory / name
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.fixture
def with_triton(monkeypatch):
    real = toolchain.importlib.util.find_spec
    monkeypatch.setattr(toolchain.importlib.util, "find_spec",
                        lambda name: object() if name == "triton" else real(name))


def test_frozen_binary_always_runs_eager(monkeypatch):
    monkeypatch.setattr(sys, "frozen", True, raising=False)
    for device in ("cuda", "cpu"):
        reason = compile_unavailable_reason(device)
        assert reason is not None and "frozen single binary" in reason


@pytest.mark.skipif(not shutil.which("g++") and not shutil.which("clang++"), reason="no C++ compiler on this host")
def test_available_with_compiler_and_headers_here():
    if not (toolchain.python_include_dir() / "Python.h").is_file():
        pytest.skip("this Python has no development headers")
    assert compile_unavailable_reason("cpu") is None


def test_no_compiler_on_path(bare_path, with_triton):
    reason = compile_unavailable_reason("cuda")
    assert "C compiler" in reason and "gcc or clang on PATH" in reason
    reason = compile_unavailable_reason("cpu")
    assert "C++ compiler" in reason and "g++" in reason


def test_compiler_named_by_env_must_exist(bare_path, monkeypatch, with_triton):
    fake_compiler(bare_path, "gcc")
    monkeypatch.setenv("CC", "/nowhere/cc-13 -O2")
    reason = compile_unavailable_reason("cuda")
    assert "$CC='/nowhere/cc-13 -O2'" in reason


def test_missing_python_headers_are_named(bare_path, tmp_path, monkeypatch, with_triton):
    fake_compiler(bare_path, "gcc")
    fake_compiler(bare_path, "g++")
    monkeypatch.setattr(sysconfig, "get_paths", lambda scheme=None: {"include": str(tmp_path / "include")})
    for device in ("cuda", "cpu"):
        reason = compile_unavailable_reason(device)
        assert "Python.h" in reason and "python3-dev" in reason
    (tmp_path / "include").mkdir()
    (tmp_path / "include" / "Python.h").write_text("")
    assert compile_unavailable_reason("cuda") is None
    assert compile_unavailable_reason("cpu") is None


def test_default_device_is_the_one_torch_would_use(bare_path, monkeypatch):
    monkeypatch.setattr(toolchain.torch.cuda, "is_available", lambda: False)
    assert "C++ compiler" in compile_unavailable_reason()
    monkeypatch.setattr(toolchain.torch.cuda, "is_available", lambda: True)
    assert compile_unavailable_reason() == compile_unavailable_reason("cuda:0")


def test_cuda_needs_triton(monkeypatch):
    real = toolchain.importlib.util.find_spec
    monkeypatch.setattr(toolchain.importlib.util, "find_spec", lambda name: None if name == "triton" else real(name))
    assert "triton" in compile_unavailable_reason("cuda")
