"""Every policy runs on the synchronous CPU engine (partitions ignored) and produces serial's greedy tokens; the
contract's queue limit and shedding reach Engine.submit; SLO classes are checked against the contract."""
from __future__ import annotations

import pytest
import torch
from latency_tables import SlowTable

from appliance.config import Config
from appliance.engine.engine import Engine
from appliance.engine.factory import build_engine
from appliance.engine.launched import prefill_launches
from appliance.engine.planners.mux import MuxOptions, MuxPlanner
from appliance.engine.request import SamplingParams
from appliance.errors import CapacityError, ConfigError, RequestError
from appliance.predictor.contention import ContentionGuard
from appliance.predictor.host import HostModel
from appliance.predictor.predictor import Predictor

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)

NO_HOST = HostModel(0.0, 0.0, 0.0, 0.0)  # these rules are checked on device times alone


class ChunkTable(SlowTable):
    """Mixed steps of 5 ms + 2 ms a token: a whole prompt misses the 50 ms TBT, a 17-token chunk fits 0.8 x 50."""

    def mixed_ms(self, items, load, sms):
        return 5.0 + 2.0 * sum(i.new for i in items)


class TemporalTable(SlowTable):
    """Prefill on all SMs 0.5 ms a token, beside decode 10 ms a token: decode then layers on all SMs go faster."""

    def prefill_ms(self, items, sms):
        return (0.5 if sms >= 132 else 10.0) * sum(i.new for i in items)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, 250, (n,), generator=g).tolist() for n in (40, 9, 33, 17, 25)]


def staggered(engine: Engine) -> list[list[int]]:
    """Two prompts first, the rest after a few steps, so prefills meet running decodes."""
    reqs = [engine.make_request(p, GREEDY) for p in prompts()]
    for r in reqs[:2]:
        engine.submit(r)
    for _ in range(3):
        engine.step()
    for r in reqs[2:]:
        engine.submit(r)
    while engine.has_unfinished():
        engine.step()
    return [r.output_token_ids for r in reqs]


@pytest.fixture(scope="module")
def reference(llama_checkpoint):
    path, _ = llama_checkpoint
    return staggered(build_engine(Config.flat(model=path, num_gpu_blocks_override=64)))


@pytest.mark.parametrize("policy, extra", [
    ("chunked", {"chunk_budget": 12}), ("mux", {}), ("layerwise", {}), ("mux-spatial", {}), ("mux-chunks", {}),
    ("mux-temporal", {}), ("mux-passes", {}),
    ("pdmux", {}), ("pdmux-split", {"pdmux_token_budget": 20, "max_num_batched_tokens": 16})])
def test_policy_matches_serial(llama_checkpoint, reference, policy, extra):
    path, _ = llama_checkpoint
    engine = build_engine(Config.flat(model=path, num_gpu_blocks_override=64, policy=policy.split("-")[0], **extra))
    if policy in ("mux-spatial", "mux-chunks", "mux-temporal", "mux-passes"):
        planner = engine.scheduler.planner
        layers = engine.model.config.num_layers
        table = {"mux-spatial": SlowTable, "mux-chunks": ChunkTable, "mux-temporal": TemporalTable,
                 "mux-passes": SlowTable}[policy]()
        engine.scheduler.planner = MuxPlanner(engine.contract, Predictor(table, ContentionGuard(default=1.0),
                                                                         layers, 132, (16, 32), host=NO_HOST),
                                              MuxOptions(mixed_chunks=policy == "mux-chunks",
                                                         temporal=policy == "mux-temporal", control=False,
                                                         chunk_tokens=16 if policy == "mux-passes" else None))
        assert isinstance(planner, MuxPlanner)
    seen, measured = [], []
    if policy == "mux-chunks":  # every mixed step's measured time is handed to the planner (online refinement)
        engine.scheduler.planner.observe_mixed = lambda items, load, ms: measured.append((items, load, ms))
    if policy == "mux-spatial":  # and every step's prefill launches, with their host time
        engine.scheduler.planner.observe_launch = lambda launches, layers, ms, graphs: measured.append(
            (launches, layers, ms, graphs))
    inner = engine.scheduler.schedule
    engine.scheduler.schedule = lambda: seen.append(inner()) or seen[-1]
    assert staggered(engine) == reference
    assert engine.pool.num_free_pages == engine.pool.num_pages
    if policy == "chunked":
        assert any(p.mixed and p.decode and p.prefill for p in seen)
        assert all(len(p.decode) + sum(w.num_tokens for w in p.prefill) <= 12 for p in seen if p.prefill)
    if policy == "mux":  # the CPU prior finds one mixed step fast enough: aggregated
        assert engine.scheduler.planner.stats.aggregated_steps > 0
    if policy == "mux-spatial":
        spatial = [p for p in seen if p.decode_sms is not None]
        assert spatial and all(p.decode_sms == 32 and p.prefill_sms == 100 for p in spatial)
        assert any(w.layer_end - w.layer_start == 1 for p in spatial for w in p.prefill)
        launched = [p for p in seen if p.prefill and not p.mixed]
        assert [(launches, layers) for launches, layers, _, _ in measured] == [
            (len(groups), sum(end - start for (start, end), _ in groups))
            for groups in (prefill_launches(p) for p in launched)]
        assert all(ms > 0 and graphs is False for _, _, ms, graphs in measured)  # no graphs on a CPU
    if policy == "pdmux":  # short prompts: every layer in one launch, batches formed one at a time
        assert all((w.layer_start, w.layer_end) == (0, engine.model.config.num_layers) for p in seen for w in p.prefill)
        assert any(p.decode_sms is not None and p.prefill for p in seen)  # a split group (ignored on the CPU)
    if policy == "pdmux-split":  # chunks of at most 16 tokens, a batch of N tokens advancing 20 // N layers a step
        n = engine.model.config.num_layers
        for p in (p for p in seen if p.prefill):
            tokens, (w, *_) = sum(w.num_tokens for w in p.prefill), p.prefill
            assert tokens <= 16 and w.layer_end - w.layer_start in (max(1, 20 // tokens), n - w.layer_start)
        works = [w for p in seen for w in p.prefill]
        assert any(w.token_start > 0 for w in works) and any(w.layer_start > 0 for w in works)
    if policy == "mux-passes":  # prompts of 17-40 tokens prefill in passes of 16, every layer each
        works = [w for p in seen for w in p.prefill]
        assert all(w.num_tokens <= 16 for w in works)
        assert any(w.token_start > 0 and w.layer_start == 0 for w in works)
    if policy == "mux-temporal":  # decode rows, then prefill layers, in one step on all SMs
        assert engine.scheduler.planner.stats.temporal_steps > 0
        assert any(p.decode and p.prefill and not p.mixed and p.decode_sms is None for p in seen)
    if policy == "mux-chunks":  # prompts of 25-40 tokens run as 17-token chunks beside the decode rows
        assert engine.scheduler.planner.stats.chunk_steps > 0
        assert any(p.mixed and p.decode and w.token_end - w.token_start == 17 for p in seen for w in p.prefill)
        mixed = [p for p in seen if p.mixed and p.prefill]
        assert len(measured) == len(mixed) and all(ms > 0 for _, _, ms in measured)
        assert [sum(i.new for i in items) for items, _, _ in measured] == [
            sum(w.num_tokens for w in p.prefill) for p in mixed]


def write_contract(tmp_path, overload: str) -> str:
    path = tmp_path / "c.yaml"
    path.write_text(f"""\
name: tiny
targets:
  ttft: {{ms: 1000}}
  tbt: {{ms: 50}}
classes:
  chat: {{priority: 0}}
  batch: {{priority: 1}}
overload: {overload}
""")
    return str(path)


def test_contract_queue_limit(llama_checkpoint, tmp_path):
    path, _ = llama_checkpoint
    slo = write_contract(tmp_path, "{mode: queue, queue_limit: 2}")
    engine = build_engine(Config.flat(model=path, num_gpu_blocks_override=64, slo=slo, max_num_seqs=1))
    for prompt in prompts()[:3]:  # one starts on the free seat, two wait
        engine.add_request(prompt, GREEDY)
    with pytest.raises(CapacityError, match="limit 2"):
        engine.add_request(prompts()[3], GREEDY)


def test_mux_sheds_with_retry_after(llama_checkpoint, tmp_path):
    path, _ = llama_checkpoint
    slo = write_contract(tmp_path, "{mode: shed}")
    engine = build_engine(Config.flat(model=path, num_gpu_blocks_override=64, slo=slo, policy="mux"))
    layers = engine.model.config.num_layers
    engine.scheduler.planner = MuxPlanner(engine.contract, Predictor(SlowTable(), ContentionGuard(), layers, 132,
                                                                     (16, 32)))
    ids = [engine.add_request(p, GREEDY) for p in prompts()[1:]]  # 9 + 33 + 17 + 25 tokens: 840 ms
    with pytest.raises(CapacityError, match="TTFT target") as info:
        engine.add_request(prompts()[0], GREEDY)  # 400 ms of its own behind 840 ms: misses 1 s
    assert info.value.retry_after >= 1
    assert list(engine.scheduler.requests) == ids  # the shed request left nothing behind
    while engine.has_unfinished():
        engine.step()
    assert engine.pool.num_free_pages == engine.pool.num_pages


def test_slo_class_is_checked(llama_checkpoint, tmp_path):
    path, _ = llama_checkpoint
    engine = build_engine(Config.flat(model=path, num_gpu_blocks_override=64, slo=write_contract(tmp_path, "{}")))
    assert engine.slo_class("batch") == "batch" and engine.slo_class(None) is None
    with pytest.raises(RequestError, match="'premium' is not in contract 'tiny'; classes: chat, batch") as info:
        engine.slo_class("premium")
    assert info.value.param == "slo_class"
    request = engine.make_request(prompts()[0], GREEDY)
    request.slo_class = "premium"
    with pytest.raises(RequestError):
        engine.submit(request)
    default = build_engine(Config.flat(model=path, num_gpu_blocks_override=64))
    assert default.contract.class_names() == ["default"]


def test_bad_policy_and_contract_fail_at_config(llama_checkpoint, tmp_path):
    path, _ = llama_checkpoint
    with pytest.raises(ConfigError, match="mux, chunked, serial, layerwise"):
        build_engine(Config.flat(model=path, num_gpu_blocks_override=64, policy="fastest"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ntargets: {ttft: {ms: 1}, tbt: {ms: 0}}\n")
    with pytest.raises(ConfigError, match="bad.yaml:2: targets.tbt.ms"):
        build_engine(Config.flat(model=path, num_gpu_blocks_override=64, slo=str(bad)))
