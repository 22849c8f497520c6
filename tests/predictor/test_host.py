"""The host model (predictor/host.py): a step's gap from its kernels and its host work, and its fit from a step log."""
from __future__ import annotations

import numpy as np
import pytest

from appliance.predictor.host import HostModel, fit_host


def test_the_gap_hides_prefill_launches_behind_the_decode_kernels():
    host = HostModel(step_ms=1.0, per_row_us=10.0, launch_ms=0.5, per_layer_ms=1.0)
    assert host.gap(rows=100, decode_ms=20.0) == pytest.approx(20.0 + 1.0 + 1.0)
    assert host.gap(rows=100, decode_ms=20.0, layers=8) == pytest.approx(20.0 + 2.0)  # 8.5 ms of launches: hidden
    assert host.gap(rows=100, decode_ms=5.0, layers=8) == pytest.approx(8.5 + 2.0)    # longer than the kernels


def test_fit_from_a_step_log_reads_the_upper_quartile():
    rng = np.random.default_rng(0)
    steps = []
    for _ in range(400):
        rows, layers = int(rng.integers(1, 200)), int(rng.integers(0, 8))
        noise = rng.uniform(0.0, 0.4)
        steps.append({"plan_ms": 0.2, "gap_ms": 0.6 + 0.005 * rows + noise, "launch_ms": 10.0, "decode": rows,
                      "layers": layers, "prefill_launch_ms": 0.3 + 0.5 * layers + noise if layers else None})
    steps.append({"plan_ms": 0.2, "gap_ms": 900.0, "launch_ms": 1.0, "decode": 8, "layers": 0})  # an idle wait
    host = fit_host(steps)
    assert host is not None and host.source == "fitted"
    assert host.per_row_us == pytest.approx(5.0, rel=0.15) and 0.8 + 0.1 < host.step_ms < 0.8 + 0.4
    assert host.per_layer_ms == pytest.approx(0.5, rel=0.15)
    assert fit_host(steps[:10]) is None  # too few steps to say
    assert HostModel.from_dict(host.as_dict()).per_row_us == host.per_row_us
