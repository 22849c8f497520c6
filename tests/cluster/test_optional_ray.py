"""Ray is an optional extra (`pip install 'muxd[cluster]'`): the single server's path never imports it, and without
it the cluster commands say how to install it. Each check runs in a fresh interpreter (this test session may have
imported Ray for the cluster tests)."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

NO_RAY = """
import importlib.abc, sys
class NoRay(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "ray" or name.startswith("ray."):
            raise ImportError(f"No module named {name!r} (blocked by the test)")
        return None
sys.meta_path.insert(0, NoRay())
"""


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)


def test_the_single_server_path_does_not_import_ray():
    out = _python("""
        import sys
        import appliance.cli.main, appliance.cli.commands  # noqa: E401 - every command, `muxd cluster` included
        from appliance.config import Config
        from appliance.server.api import create_app
        create_app(Config.flat())  # the app `muxd serve` runs
        import appliance.cluster.router, appliance.cluster.deploy, appliance.cluster.ingress  # noqa: E401
        loaded = sorted(m for m in sys.modules if m == "ray" or m.startswith("ray."))
        print("RAY:", loaded)
    """)
    assert out.returncode == 0, out.stderr
    assert "RAY: []" in out.stdout


def test_without_ray_the_server_works_and_the_cluster_says_what_to_install():
    out = _python(NO_RAY + """
from typer.testing import CliRunner
from appliance.cli.main import app
runner = CliRunner()
assert runner.invoke(app, ["serve", "--help"]).exit_code == 0
for args in (["cluster", "--replicas", "2"], ["serve", "--replicas", "2"]):
    result = runner.invoke(app, args)
    print(args[0], result.exit_code, " ".join(result.output.split()))
""")
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stdout.splitlines() if line.startswith(("cluster ", "serve "))]
    assert len(lines) == 2
    for line in lines:
        assert line.split()[1] == "2" and "pip install 'muxd[cluster]'" in line
