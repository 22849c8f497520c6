"""Where a model named by its Hugging Face id lies on this machine: the local Hugging Face cache that vLLM and
`huggingface-cli download` fill (`$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `~/.cache/huggingface/hub`), read the
way the hub library reads it offline. muxd downloads nothing; an id not in the cache stays unresolved."""
from __future__ import annotations

import os
import re
from pathlib import Path

_MODEL_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # owner/name, as the hub spells repository ids


def cache_root(cache_dir: str | None = None) -> Path:
    """`cache_dir` where given (vLLM's --download-dir), else the hub cache directory the environment names (the hub
    library's order), whether or not it exists."""
    if cache_dir:
        return Path(cache_dir).expanduser()
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.environ[var]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(home).expanduser() / "hub"


def is_model_id(name: str) -> bool:
    """Whether `name` reads as a hub id (owner/name) rather than a path."""
    return bool(_MODEL_ID.match(name)) and ".." not in name


def cached_snapshot(model_id: str, revision: str | None = None, cache_dir: str | None = None) -> Path | None:
    """The cached snapshot directory of `model_id` at `revision` (a branch or tag the cache has a ref for, or a
    commit); with no revision asked for, main's, or without a ref for main the only snapshot the cache holds. None
    when the cache holds none of it."""
    if revision is not None and (".." in revision or revision.startswith("/")):
        return None  # a name, never a path out of the cache
    repo = cache_root(cache_dir) / f"models--{model_id.replace('/', '--')}"
    snapshots = repo / "snapshots"
    ref = repo / "refs" / (revision or "main")
    if ref.is_file():
        snapshot = snapshots / ref.read_text().strip()
    elif revision:
        snapshot = snapshots / revision  # a commit
    else:
        found = [p for p in snapshots.iterdir() if p.is_dir()] if snapshots.is_dir() else []
        snapshot = found[0] if len(found) == 1 else None
    return snapshot if snapshot is not None and snapshot.is_dir() else None


def local_model_dir(name: str, revision: str | None = None, cache_dir: str | None = None) -> Path:
    """`name` as a path where it exists; else, for a hub id, its cached snapshot (at `revision`, in `cache_dir`)
    where the cache has one; else the path (whose absence the loader reports)."""
    path = Path(name).expanduser()
    if not path.exists() and is_model_id(name):
        return cached_snapshot(name, revision, cache_dir) or path
    return path


def not_found(name: str, revision: str | None = None, cache_dir: str | None = None) -> str:
    """What to say of a model `name` that is neither a directory nor cached (at `revision`, in `cache_dir`)."""
    if is_model_id(name):
        at = f" at revision {revision}" if revision else ""
        fetch = f"huggingface-cli download {name}" + (f" --revision {revision}" if revision else "")
        return (f"{name}: no such model directory, and the Hugging Face cache ({cache_root(cache_dir)}) holds no "
                f"snapshot of it{at}; muxd downloads nothing: fetch it first (`{fetch}`) or give a directory")
    return f"{name}: model directory not found"
