"""The host model (predictor/host.py): a step's gap from its kernels and its host work, and its fit from a step log."""
from __future__ import annotations

import numpy as np
import pytest

from appliance.predictor.host import LAUNCH_WINDOW, MIN_LAUNCHES, HostModel, LaunchCost, _line, _quantile, fit_host


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


def test_the_overlapped_loop_hides_the_host_behind_the_device():
    sync = HostModel(step_ms=1.0, per_row_us=10.0, launch_ms=0.5, per_layer_ms=1.0)
    over = sync.with_loop(True)
    assert over.gap(rows=100, decode_ms=20.0) == pytest.approx(20.0)  # 2 ms of host work run during the kernels
    assert over.gap(rows=100, decode_ms=20.0, layers=8) == pytest.approx(20.0)  # 2 + 8.5 ms: hidden too
    assert over.gap(rows=100, decode_ms=5.0, layers=8) == pytest.approx(2.0 + 8.5)  # the host is the longer part
    assert sync.gap(rows=100, decode_ms=20.0) == pytest.approx(22.0)
    # host time left for prefill launches within a 30 ms target beside a 20 ms decode step
    assert sync.launch_room(100, 20.0, 30.0) == pytest.approx(28.0)
    assert over.launch_room(100, 20.0, 30.0) == pytest.approx(28.0)
    assert sync.launch_room(100, 40.0, 30.0) == pytest.approx(40.0)  # a decode step already past the target
    assert over.launch_room(100, 40.0, 30.0) == pytest.approx(38.0)
    assert (sync.device_room(100, 30.0), over.device_room(100, 30.0)) == (pytest.approx(28.0), 30.0)
    assert "overlapped" not in over.as_dict()  # a property of the engine's loop, not of the profiled host


def test_launches_measured_while_serving_replace_the_profiled_launch_times():
    """The launch time is learned online as a line through what the engine measures (a fixed part per launch, a part
    per layer), raised to the 98th percentile of its residuals: the idle host's figures hold until enough launches
    were seen, then a serving host's (one slow launch in a hundred is not planned for; one in five is). Launches that
    all hold as many layers give the per-layer part alone."""
    cost, model = LaunchCost(), HostModel(step_ms=1.0, per_row_us=0.0, launch_ms=0.5, per_layer_ms=1.0)
    for i in range(MIN_LAUNCHES - 1):
        model = cost.observe(model, launches=1, layers=4 + i % 8, measured_ms=5.0 + 0.1 * (4 + i % 8))
    assert (model.launch_ms, model.per_layer_ms) == (0.5, 1.0)  # too few to say
    for i in range(LAUNCH_WINDOW):  # two launches a step, 2 to 15 layers each; three steps in 256 8 ms slower (4, 9
        # and 13 layers: about one in a hundred, spread over the layer counts)
        layers = 2 + i % 14
        model = cost.observe(model, launches=2, layers=2 * layers,
                             measured_ms=2 * (5.0 + 0.1 * layers) + (16.0 if i in (2, 105, 207) else 0.0))
    assert 4.9 <= model.launch_ms < 5.5 and model.per_layer_ms == pytest.approx(0.1, abs=0.02)
    for i in range(LAUNCH_WINDOW // 5):  # now one launch in five takes 6 ms more
        layers = 2 + i % 14
        model = cost.observe(model, launches=1, layers=layers, measured_ms=5.0 + 0.1 * layers + 6.0)
    assert model.launch_ms > 10.0  # planned for
    assert model.step_ms == 1.0  # the rest stays as profiled
    same = LaunchCost()
    for _ in range(MIN_LAUNCHES):  # every launch of 10 layers: no slope to fit
        flat = same.observe(HostModel(launch_ms=0.5, per_layer_ms=1.0), launches=1, layers=10, measured_ms=20.5)
    assert (flat.launch_ms, flat.per_layer_ms) == (0.5, pytest.approx(2.0))
    assert cost.observe(model, launches=0, layers=0, measured_ms=3.0) is model  # nothing launched: nothing learned
    assert cost.observe(model, launches=1, layers=10, measured_ms=80.0) is model  # a compile, or a CPU engine
    assert HostModel(1.0, 10.0, 0.5, 2.0).scaled(1.5) == HostModel(1.5, 15.0, 0.75, 3.0)


def test_launches_that_replay_graphs_are_priced_and_learned_apart_from_eager_ones():
    """A prefill launch of at most the engine's graph rows replays piecewise graphs, a layer at a fraction of an
    eager one's host time (served on an H200: 0.18-0.23 against 0.8-1.2 ms): the model prices each kind with its own
    line, learns the two from their own launches, and a profile without graph figures takes its eager ones scaled
    by the prior's ratio."""
    host = HostModel(step_ms=1.0, per_row_us=0.0, launch_ms=2.0, per_layer_ms=1.0).with_loop(True)
    assert (host.graph_launch_ms, host.graph_per_layer_ms) == (2.0, pytest.approx(0.375))  # derived
    assert not host.replays_graphs(512)  # no graphs captured (a CPU engine): every launch eager
    graphs = host.with_graphs(2048)
    assert graphs.replays_graphs(2048) and not graphs.replays_graphs(2049) and not graphs.replays_graphs(0)
    assert graphs.prefill_launch(32, tokens=1000) == pytest.approx(2.0 + 0.375 * 32)
    assert graphs.prefill_launch(32, tokens=4000) == pytest.approx(2.0 + 32.0)
    assert graphs.prefill_launch(0, tokens=1000) == 0.0
    assert graphs.gap(rows=100, decode_ms=5.0, layers=32, tokens=4000) == pytest.approx(1.0 + 34.0)
    assert graphs.gap(rows=100, decode_ms=5.0, layers=32, tokens=1000) == pytest.approx(1.0 + 14.0)
    assert graphs.launch_costs(1000) == (2.0, pytest.approx(0.375)) and graphs.launch_costs(4000) == (2.0, 1.0)
    assert "graph_rows" not in graphs.as_dict() and HostModel.from_dict(graphs.as_dict()) == HostModel(
        1.0, 0.0, 2.0, 1.0, 2.0, 0.375, "profile")
    assert graphs.launch_scaled(2.0).prefill_launch(32, tokens=1000) == pytest.approx(2 * (2.0 + 0.375 * 32))
    cost, model = LaunchCost(), graphs
    rng = np.random.default_rng(1)
    for _ in range(2 * LAUNCH_WINDOW):
        layers, eager = int(rng.integers(2, 33)), bool(rng.integers(0, 2))
        ms = (1.5 + 1.1 * layers) if eager else (1.8 + 0.2 * layers)
        model = cost.observe(model, launches=1, layers=layers, measured_ms=ms, graphs=not eager)
    assert model.per_layer_ms == pytest.approx(1.1, abs=0.01) and model.launch_ms == pytest.approx(1.5, abs=0.05)
    assert model.graph_per_layer_ms == pytest.approx(0.2, abs=0.01)
    assert model.graph_launch_ms == pytest.approx(1.8, abs=0.05)
    # a step log that says which launches replayed graphs fits the two apart; one that does not, eager alone
    steps = [{"plan_ms": 0.2, "gap_ms": 0.5, "launch_ms": 10.0, "decode": 8, "layers": layers,
              "prefill_launch_ms": (1.0 + 1.0 * layers) if i % 2 else (1.0 + 0.25 * layers),
              "prefill_graphs": not i % 2}
             for i, layers in enumerate(int(x) for x in rng.integers(2, 33, size=200))]
    fitted = fit_host(steps)
    assert fitted.per_layer_ms == pytest.approx(1.0, abs=0.01) and fitted.graph_per_layer_ms == pytest.approx(0.25,
                                                                                                             abs=0.01)
    old = fit_host([{k: v for k, v in s.items() if k != "prefill_graphs"} for s in steps if not s["prefill_graphs"]])
    assert old.per_layer_ms == pytest.approx(1.0, abs=0.01)
    assert old.graph_per_layer_ms == pytest.approx(old.per_layer_ms * 0.375)


def test_the_refit_at_every_launch_is_the_least_squares_line_and_numpy_s_quantile():
    """The online launch line refits in closed form and takes its quantile from a partial sort (on the engine thread,
    at every prefill launch): the same figures as np.polyfit and np.quantile."""
    rng = np.random.default_rng(0)
    for n in (1, 2, 3, 16, 255, 256):
        values = rng.random(n) * 10
        for q in (0.0, 0.3, 0.5, 0.75, 0.98, 1.0):
            assert _quantile(values, q) == pytest.approx(float(np.quantile(values, q)), rel=1e-12)
    x = rng.integers(1, 33, 256).astype(float)
    y = 0.5 + 0.3 * x + rng.random(256)
    slope, intercept = np.polyfit(x, y, 1)
    intercept += np.quantile(y - (intercept + slope * x), 0.98)
    assert _line(x, y, 0.98) == pytest.approx((intercept, slope), rel=1e-9)
