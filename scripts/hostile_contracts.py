"""Hostile SLO contracts and what `muxd slo check` makes of them: for each, the exit code, the one line it prints,
its wall time and its peak resident memory (VmHWM of the command's own process). The test suite runs the same cases
(tests/slo/test_hostile_contracts.py); this prints the figures for docs/RELIABILITY.md.

    python scripts/hostile_contracts.py --out docs/hostile-contracts.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ALIAS_BOMB = "a: &a [" + ",".join(['"lol"'] * 9) + "]\n" + "".join(
    f"{c}: &{c} [" + ",".join([f"*{p}"] * 9) + "]\n" for p, c in zip("abcdefgh", "bcdefghi"))
MERGE_BOMB = "a: &a {x: 1, y: 2}\n" + "".join(
    f"{c}: &{c} {{<<: [" + ", ".join([f"*{p}"] * 4) + f"], k{c}: 1}}\n" for p, c in zip("abcdefghijklmnop",
                                                                                         "bcdefghijklmnopq"))
# name -> (file content, words the refusal names); "huge" is grown to 100 MB (sparse) when written
HOSTILE: dict[str, tuple[bytes, str]] = {
    "alias-bomb": (ALIAS_BOMB.encode(), "aliases expand to more than"),
    "merge-bomb": (MERGE_BOMB.encode(), "aliases expand to more than"),
    "recursive-alias": (b"name: &a [*a]\n", "contains it"),
    "recursive-mapping": (b"targets: &t {ttft: *t}\n", "contains it"),
    "deep-flow": (b"name: " + b"[" * 50_000 + b"\n", "nested deeper than"),
    "deep-block": ("".join("  " * i + f"k{i}:\n" for i in range(200)).encode(), "nested deeper than"),
    "deep-alias": (("a: &a " + "[" * 60 + "1" + "]" * 60 + "\n" + "b: &b " + "[" * 60 + "*a" + "]" * 60 + "\n"
                    ).encode(), "nested deeper than"),
    "not-utf8": (b"name: caf\xe9\n", "is not UTF-8"),
    "control-char": (b"name: a\x07b\n", "not allowed in YAML"),
    "huge": (b"name: x\n", "larger than 64 KiB"),
}
# `muxd slo check PATH`, reporting its own peak resident memory on the last line of stderr
MEASURED = ("import atexit, re, sys; from pathlib import Path; "
            "atexit.register(lambda: sys.stderr.write('\\nVmHWM ' + re.search(r'VmHWM:\\s+(\\d+)', "
            "Path('/proc/self/status').read_text()).group(1) + '\\n')); "
            "sys.argv = ['muxd', 'slo', 'check', sys.argv[1]]; from appliance.cli.main import main; main()")


def write(name: str, directory: Path) -> Path:
    path = directory / f"{name}.yaml"
    path.write_bytes(HOSTILE[name][0])
    if name == "huge":
        os.truncate(path, 100 << 20)
    return path


def check(path: Path) -> dict:
    """Run `muxd slo check` on one file in a process of its own."""
    started = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", MEASURED, str(path)], cwd=ROOT, capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "300"}, timeout=120)
    seconds = time.perf_counter() - started
    *lines, peak = [line for line in result.stderr.splitlines() if line.strip()]
    return {"exit_code": result.returncode, "stderr_lines": lines, "stdout": result.stdout,
            "seconds": round(seconds, 2), "peak_rss_mib": round(int(peak.split()[1]) / 1024, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        figures = {}
        for name in HOSTILE:
            figures[name] = check(write(name, Path(tmp)))
            figures[name]["stderr_lines"] = [line.replace(tmp + "/", "") for line in figures[name]["stderr_lines"]]
    for name, f in figures.items():  # one line per case; the JSON (with --out) holds everything
        print(f"{name:18} exit {f['exit_code']}  {f['seconds']:5.2f} s  {f['peak_rss_mib']:6.1f} MiB  "
              f"{f['stderr_lines'][0] if f['stderr_lines'] else ''}")
    if args.out:
        args.out.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
