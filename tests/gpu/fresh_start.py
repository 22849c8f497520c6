"""Starts muxd's engine in a process of its own, decodes prompts greedily and prints what the start recorded, the
outputs and the decode graphs' replays, as one JSON line. The GPU tests that check what a cold start compiles run
their engines through it: a process that compiled before keeps compile workers and in-memory caches that a new cache
directory does not reach.

    python tests/gpu/fresh_start.py '{"config": {...}, "prompts": [[5, 6, 7]], "max_tokens": 64}'

`config`: the keyword arguments of `Config.flat`.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main(spec: dict) -> dict:
    from appliance.config import Config
    from appliance.engine.factory import build_engine
    from appliance.engine.request import SamplingParams

    greedy = SamplingParams(max_tokens=spec["max_tokens"], temperature=0, ignore_eos=True)
    engine = build_engine(Config.flat(**spec["config"]))
    try:
        outputs = [engine.generate([p], greedy)[0].token_ids for p in spec["prompts"]]
        graphs = engine.runner.graphs
        return {"startup": engine.startup, "outputs": outputs, "replays": graphs.replays if graphs else 0}
    finally:
        engine.close()


def run(spec: dict, cache: Path, env: dict[str, str] | None = None) -> dict:
    """main(spec) in a new Python process whose compile caches all lie under `cache` (a fresh directory: a cold
    start), with `env` added to this process's environment."""
    full = {**os.environ, "MUXD_CACHE_DIR": str(cache), "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
            "TRITON_CACHE_DIR": str(cache / "triton"), **(env or {})}
    full["PYTHONPATH"] = os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), json.dumps(spec)], env=full, cwd=ROOT,
                          capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, f"the engine's process failed ({done.returncode}):\n{done.stderr[-4000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1])), default=str))
