"""The GPU fast path (flashinfer + torch.compile + decode CUDA graphs) against the torch reference backend, in bf16,
on a small model trained to continue periodic sequences (confident predictions that need attention to be right)."""
from __future__ import annotations

import pytest
from copy_model import PERIOD, periodic_prompt

from appliance.config import Config
from appliance.engine.engine import Engine
from appliance.engine.factory import build_engine
from appliance.engine.request import SamplingParams

GREEDY = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)


# the fast path's engine: Config.flat's keyword arguments beside the model
FAST = {"device": "cuda", "num_gpu_blocks_override": 512, "max_num_seqs": 32, "attention_backend": "flashinfer",
        "compile": True, "cuda_graph": True}


def fast(path, **kw) -> Engine:
    return build_engine(Config.flat(model=path, **FAST, **kw))


def reference(path) -> Engine:
    return build_engine(Config.flat(model=path, device="cuda",
                                    num_gpu_blocks_override=512, max_num_seqs=32, attention_backend="torch",
                                    compile=False, cuda_graph=False))


def decodes_as_reference(engine: Engine, ref: Engine, batches: tuple[int, ...], step: int) -> None:
    """Batches of `batches` rows (prompts of 30, 30 + step, ... tokens) decode greedily as `ref` does, some steps
    replay graphs, and every page comes back."""
    for n in batches:
        prompts = [periodic_prompt(seed, 30 + step * seed) for seed in range(n)]
        assert [c.token_ids for c in engine.generate(prompts, GREEDY)] == [c.token_ids for c in ref.generate(
            prompts, GREEDY)]
    assert engine.runner.graphs.replays > 0
    assert engine.pool.num_free_pages == engine.pool.num_pages


def test_fast_path_greedy_equals_torch_backend(copy_model):
    from torch._dynamo.utils import counters  # imported here: at collection it cost seconds on every pytest worker

    counters.clear()
    engine, ref = fast(copy_model), reference(copy_model)
    assert engine.runner.backend_name == "flashinfer" and engine.compiled and engine.runner.graphs is not None
    shared = periodic_prompt(1, 2 * PERIOD + 5)
    for e in (engine, ref):  # fill the prefix cache with the shared prompt's pages
        e.generate(shared, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    prompts = [shared + periodic_prompt(1, 2 * PERIOD + 20)[2 * PERIOD + 5:]]       # cached prefix + suffix
    prompts += [periodic_prompt(seed, 30 + 7 * seed) for seed in range(2, 7)]          # fresh prompts
    out = engine.generate(prompts, GREEDY)
    expected = ref.generate(prompts, GREEDY)
    assert out[0].num_cached_tokens >= 32 and expected[0].num_cached_tokens >= 32
    assert [c.token_ids for c in out] == [c.token_ids for c in expected]
    # the model is right, not just consistent: the continuation repeats the period
    for p, c in zip(prompts, out):
        full = p + c.token_ids
        assert full[PERIOD:] == full[:-PERIOD]
    assert engine.runner.graphs.replays > 0
    # one compiled layer serves every layer and batch size: the single-token graph and the dynamic one, the latter
    # apart for SplitKLinear's few rows and for more, each with and without a residual (6 graphs); the final norm up
    # to 3 more (one row, few rows' partial products, more rows)
    assert counters["stats"]["unique_graphs"] <= 9
    assert engine.pool.num_free_pages == engine.pool.num_pages


@pytest.mark.parametrize("decode_kernel", ["auto", "flashinfer"])
def test_graphs_and_eager_decode_agree_at_every_batch_size(copy_model, decode_kernel):
    """(auto: the 16-row graph runs muxd's balanced decode attention; flashinfer: flashinfer's at every size)"""
    engine = fast(copy_model, decode_kernel=decode_kernel)
    prompts = [periodic_prompt(seed, 25 + seed) for seed in range(11)]  # 11 rows: padded to a captured 16
    with_graphs = engine.generate(prompts, GREEDY)
    engine.runner.use_graphs = False
    eager = engine.generate(prompts, GREEDY)
    assert [c.token_ids for c in with_graphs] == [c.token_ids for c in eager]


@pytest.mark.parametrize("folded", [True, False])
def test_rope_in_the_split_kernel_decodes_as_the_rotary_kernel(copy_model, monkeypatch, folded):
    """With the rotary kernel's work folded into the split-KV decode kernel (`triton_decode.ROPE_IN_ATTENTION`, the
    default) and without it (the rotary kernel, then the split kernel), the graphs of 1 to 8 rows decode greedily as
    the torch backend does, beside eager steps, and free every page."""
    from appliance.attention import triton_decode

    monkeypatch.setattr(triton_decode, "ROPE_IN_ATTENTION", folded)
    engine, ref = fast(copy_model), reference(copy_model)
    split = [b.triton for _, b in engine.runner.graphs._graphs.values()
             if isinstance(b.triton, triton_decode.TritonDecode)]
    assert split and all(t.fuses_rope == folded for t in split)
    decodes_as_reference(engine, ref, (1, 3, 8), 5)


def test_given_capture_sizes_are_the_graphs_and_larger_batches_run_eagerly(copy_model):
    """vLLM's --cudagraph-capture-sizes: the engine captures exactly those decode graphs; a batch of 2 rows replays
    the 3-row graph, one of 5 rows runs eagerly; both decode as the torch backend does."""
    engine, ref = fast(copy_model, cudagraph_capture_sizes=[1, 3]), reference(copy_model)
    assert engine.runner.graphs.sizes == [1, 3] and engine.max_graph_batch == 3
    assert (engine.runner.graphs.padded_size(2), engine.runner.graphs.padded_size(5)) == (3, None)
    decodes_as_reference(engine, ref, (2, 5), 3)


def test_seeded_sampling_does_not_depend_on_the_batch(copy_model):
    """A seeded request draws the same tokens beside one request and in a batch of 32 (other rows, other seeds, some
    unseeded), and again when it runs again. (Alone, one-row decode runs other kernels, tuned for a single row,
    whose logits differ in the last bits: at temperature 3 that may change a draw, so "alone" is not compared.)"""
    engine = fast(copy_model)
    seeded = SamplingParams(max_tokens=24, temperature=3.0, seed=1234, ignore_eos=True)
    prompt = periodic_prompt(3, 40)
    companion = SamplingParams(max_tokens=24, temperature=3.0, ignore_eos=True)
    pair = engine.generate([prompt, periodic_prompt(99, 30)], [seeded, companion])[0].token_ids
    others = [periodic_prompt(100 + i, 20 + i) for i in range(31)]
    params = [SamplingParams(max_tokens=24, temperature=3.0, seed=None if i % 2 else i, ignore_eos=True)
              for i in range(31)]
    batch = engine.generate([prompt] + others, [seeded] + params)
    assert batch[0].token_ids == pair
    alone = engine.generate(prompt, seeded)[0].token_ids
    assert engine.generate(prompt, seeded)[0].token_ids == alone
    other_seed = engine.generate(prompt, SamplingParams(max_tokens=24, temperature=3.0, seed=99, ignore_eos=True))
    assert other_seed[0].token_ids != alone  # the seed matters: sampling is not collapsing to greedy


def test_allowed_token_ids_on_the_fast_path(copy_model):
    """A row limited to a few ids samples only those on the GPU (decode graphs, the overlapped loop), beside rows
    without a limit that decode as they do without it."""
    engine = fast(copy_model)
    prompts = [periodic_prompt(i, 40) for i in range(4)]
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    free = engine.generate(prompts[1:], [greedy] * 3)
    limited = SamplingParams(max_tokens=24, temperature=1.0, seed=7, ignore_eos=True, allowed_token_ids=[5, 11, 17])
    out = engine.generate(prompts, [limited] + [greedy] * 3)
    assert len(out[0].token_ids) == 24 and set(out[0].token_ids) <= {5, 11, 17}
    assert [c.token_ids for c in out[1:]] == [c.token_ids for c in free]
    assert engine.pool.num_free_pages == engine.pool.num_pages


def test_bad_words_on_the_fast_path(copy_model):
    """A word of two tokens taken from a row's greedy output never appears in it on the GPU (decode graphs, the
    overlapped loop, the row sampled once its latest token is read), beside rows that decode as they do without it."""
    engine = fast(copy_model)
    prompts = [periodic_prompt(i, 40) for i in range(4)]
    greedy = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    free = [c.token_ids for c in engine.generate(prompts, [greedy] * 4)]
    word = free[0][3:5]
    first = next(k for k in range(31) if free[0][k:k + 2] == word)
    banned = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, bad_words_token_ids=[word])
    out = [c.token_ids for c in engine.generate(prompts, [banned] + [greedy] * 3)]
    assert len(out[0]) == 32 and out[0][:first + 1] == free[0][:first + 1]
    assert all(out[0][k:k + 2] != word for k in range(31))
    assert out[1:] == free[1:]
    assert engine.pool.num_free_pages == engine.pool.num_pages


def test_fast_path_frees_every_page_after_aborts(copy_model):
    engine = fast(copy_model)
    ids = [engine.add_request(periodic_prompt(s, 50), SamplingParams(max_tokens=40, ignore_eos=True))
           for s in range(8)]
    for _ in range(5):
        engine.step()
    for rid in ids[::2]:
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    assert engine.pool.num_free_pages == engine.pool.num_pages
    assert not engine.runner.batches._mirrors
