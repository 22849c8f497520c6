"""Whether torch.compile can work in this process. Compiled code is built at run time: Triton compiles a C launcher
for its GPU kernels, Inductor compiles C++ for CPU code, and both include Python's headers. A frozen single binary
or a slim image lacks that toolchain; callers run eager with the reason this module gives.
"""
from __future__ import annotations

import importlib.util
import os
import shlex
import shutil
import sys
import sysconfig
from pathlib import Path

import torch


def _find(env: str, candidates: tuple[str, ...]) -> tuple[str | None, str]:
    """(path of the compiler, what was looked for); the environment variable wins when set, as in Triton/Inductor."""
    chosen = os.environ.get(env)
    if chosen:
        words = shlex.split(chosen)
        return (shutil.which(words[0]) if words else None), f"${env}={chosen!r}"
    for name in candidates:
        path = shutil.which(name)
        if path:
            return path, name
    return None, " or ".join(candidates) + f" on PATH (or ${env})"


def python_include_dir() -> Path:
    """Where compiled extensions look for Python.h (Triton reads the same scheme)."""
    scheme = sysconfig.get_default_scheme()
    if scheme == "posix_local":  # Debian's scheme; its headers live under posix_prefix
        scheme = "posix_prefix"
    return Path(sysconfig.get_paths(scheme=scheme)["include"])


def compile_unavailable_reason(device: str | torch.device | None = None) -> str | None:
    """None when torch.compile can build code for `device` here (default: CUDA when available, else CPU);
    otherwise one sentence saying what is missing and how to get it."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = str(device)
    if getattr(sys, "frozen", False):
        return ("muxd runs from a frozen single binary, which carries no C compiler or Python headers for "
                "torch.compile; install muxd with pip to compile")
    if device.startswith("cuda"):
        if importlib.util.find_spec("triton") is None:
            return "torch.compile on CUDA needs the triton package, which is not installed"
        compiler, looked_for = _find("CC", ("gcc", "clang"))
        kind = "C compiler (Triton builds its kernel launchers with it)"
    else:
        compiler, looked_for = _find("CXX", ("g++", "clang++", "c++"))
        kind = "C++ compiler (Inductor builds CPU kernels with it)"
    if compiler is None:
        return f"torch.compile needs a {kind}: none found ({looked_for}); install gcc/g++ or build-essential"
    header = python_include_dir() / "Python.h"
    if not header.is_file():
        return (f"torch.compile needs Python's development headers: {header} is missing; install python3-dev "
                f"(or python{sys.version_info.major}.{sys.version_info.minor}-dev)")
    return None
