"""The OpenAI/vLLM sampling options on the engine: penalties against a row-by-row reference, logit_bias, min_tokens,
bad words, min_p, and log-probabilities (sampled and prompt) checked against a transformers forward of the same
checkpoint."""
from __future__ import annotations

import math

import pytest
import torch

from appliance.config import Config
from appliance.engine.factory import build_engine
from appliance.engine.grammar import GrammarSpec
from appliance.engine.logits import PenaltyCounts, process_logits
from appliance.engine.request import Request, RequestOutput, SamplingParams, ThinkingLimit, TokenLogprob
from appliance.errors import ConfigError, RequestError

PROMPT = [1] + [(7 * i + 3) % 250 + 3 for i in range(36)]  # three pages of 16, the last partial


@pytest.fixture(scope="module")
def llama(llama_checkpoint):
    path, hf = llama_checkpoint
    return build_engine(Config.flat(model=path, num_gpu_blocks_override=64)), hf


def run(engine, prompt, params: SamplingParams) -> list[RequestOutput]:
    rid = engine.add_request(prompt, params)
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == rid]
    return outs


def _reference_penalties(logits: torch.Tensor, prompt: list[int], output: list[int], sp: SamplingParams):
    out = logits.clone()
    for t in set(prompt) | set(output):
        if sp.repetition_penalty != 1.0:
            out[t] = out[t] / sp.repetition_penalty if out[t] > 0 else out[t] * sp.repetition_penalty
    for t in set(output):
        out[t] -= sp.frequency_penalty * output.count(t) + sp.presence_penalty
    return out


def test_penalties_match_a_row_by_row_reference():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=g) * 3
    params = [SamplingParams(repetition_penalty=1.3), SamplingParams(frequency_penalty=0.7, presence_penalty=-0.4),
              SamplingParams(), SamplingParams(repetition_penalty=0.8, frequency_penalty=-1.0, presence_penalty=2)]
    reqs = []
    for i, sp in enumerate(params):
        r = Request(f"r{i}", [(3 * i + k) % 50 for k in range(7)], sp)
        r.output_token_ids = [(5 * i + k * k) % 50 for k in range(9)]
        reqs.append(r)
    expected = torch.stack([_reference_penalties(logits[i], r.prompt_token_ids, r.output_token_ids, r.sampling)
                            for i, r in enumerate(reqs)])
    got = process_logits(logits.clone(), reqs)
    assert torch.allclose(got, expected, atol=1e-5)
    assert torch.equal(got[2], logits[2])  # a row without penalties is untouched


def test_device_token_counts_penalise_as_the_host_lists_do():
    """The penalties' counts kept on the device (filled from the host's lists at a request's first sample, then
    counted there as it samples) give the same logits as counting the lists; a row given back and taken by another
    request starts from that request's own tokens."""
    g = torch.Generator().manual_seed(1)
    params = [SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4), SamplingParams(presence_penalty=0.6),
              SamplingParams(repetition_penalty=0.8, presence_penalty=-0.5, frequency_penalty=1.1)]
    reqs = []
    for i, sp in enumerate(params):
        r = Request(f"r{i}", [(7 * i + k) % 50 for k in range(6)], sp)
        r.output_token_ids = [(3 * i + k) % 50 for k in range(i)]  # (none, one, two tokens so far)
        reqs.append(r)
    counts = PenaltyCounts(50, torch.device("cpu"))
    for step in range(6):
        logits = torch.randn(3, 50, generator=g) * 3
        expected = process_logits(logits.clone(), reqs)
        got = process_logits(logits.clone(), reqs, penalties=counts)
        assert torch.allclose(got, expected, atol=1e-6), step
        sampled = torch.randint(0, 50, (3,), generator=g)
        counts.count(reqs, [0, 1, 2], sampled)
        for r, t in zip(reqs, sampled.tolist()):
            r.output_token_ids.append(t)
    counts.release("r1")
    fresh = Request("r9", [1, 2, 3], SamplingParams(frequency_penalty=2.0, repetition_penalty=1.5))
    fresh.output_token_ids = [4, 4]
    logits = torch.randn(1, 50, generator=g)
    assert torch.allclose(process_logits(logits.clone(), [fresh], penalties=counts),
                          process_logits(logits.clone(), [fresh]), atol=1e-6)
    assert len(counts.counts) == 8  # (the released row was taken again)


def test_logit_bias_and_min_tokens(llama):
    engine, _ = llama
    forced = run(engine, PROMPT, SamplingParams(max_tokens=5, temperature=0.9, seed=1, logit_bias={42: 100.0}))
    assert [o.new_token_ids[0] for o in forced] == [42] * 5
    eos = sorted(engine.eos_token_ids)[0]
    # EOS made overwhelmingly likely: it still waits for min_tokens, then ends the output
    outs = run(engine, PROMPT, SamplingParams(max_tokens=20, temperature=0, logit_bias={eos: 100.0}, min_tokens=4))
    tokens = [o.new_token_ids[0] for o in outs]
    assert len(tokens) == 5 and eos not in tokens[:4] and tokens[4] == eos and outs[-1].finish_reason == "stop"


def test_allowed_token_ids_beside_rows_without_them(llama):
    """A row that allows a few tokens samples only those, penalised and biased or not, while a row of the same
    batch without the option is left as it samples alone (greedy: the same tokens)."""
    engine, _ = llama
    alone = [o.new_token_ids[0] for o in run(engine, PROMPT, SamplingParams(max_tokens=6, temperature=0))]
    kept = SamplingParams(max_tokens=6, temperature=1.0, seed=5, allowed_token_ids=[9, 42, 77], ignore_eos=True,
                          presence_penalty=0.5, logit_bias={42: -100.0})
    ids = [engine.add_request(PROMPT, kept), engine.add_request(PROMPT, SamplingParams(max_tokens=6, temperature=0))]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    assert len(tokens[ids[0]]) == 6 and set(tokens[ids[0]]) <= {9, 77}  # (42 biased away)
    assert tokens[ids[1]] == alone


def test_bad_words_mask_one_token_words_always_and_a_longer_word_after_the_rest_of_it():
    logits = torch.zeros(4, 20)
    params = [SamplingParams(bad_words_token_ids=[[5], [9]]), SamplingParams(bad_words_token_ids=[[3, 4, 7], [4, 8]]),
              SamplingParams(), SamplingParams(bad_words_token_ids=[[3, 4, 7]])]
    reqs = [Request(f"r{i}", [1, 3, 4], sp) for i, sp in enumerate(params)]
    reqs[0].output_token_ids = [2]
    reqs[1].output_token_ids = [6, 3, 4]  # ends with the first word's prefix [3, 4] (and the second's, [4])
    reqs[2].output_token_ids = [3, 4]
    reqs[3].output_token_ids = []  # the prompt ends with [3, 4]; only the output counts
    got = process_logits(logits.clone(), reqs)
    banned = [(i, t) for i in range(4) for t in range(20) if got[i, t] == float("-inf")]
    assert banned == [(0, 5), (0, 9), (1, 7), (1, 8)]
    for output in ([3, 4, 2], [3, 4, 7], [4, 3]):  # the prefix earlier in the output, or cut: nothing masked
        reqs[1].output_token_ids = output
        assert process_logits(logits.clone(), reqs)[1].isfinite().all()
    reqs[3].output_token_ids = [3, 4]
    assert process_logits(logits.clone(), reqs)[3, 7] == float("-inf")


def test_bad_words_change_greedy_output_only_where_they_would_appear(llama):
    """Through the engine's loop (a word of several tokens: sampled once its latest token is read)."""
    engine, _ = llama
    greedy = dict(max_tokens=8, temperature=0, ignore_eos=True)
    alone = [o.new_token_ids[0] for o in run(engine, PROMPT, SamplingParams(**greedy))]
    single = [o.new_token_ids[0] for o in run(engine, PROMPT, SamplingParams(**greedy,
                                                                             bad_words_token_ids=[[alone[2]]]))]
    assert single[:2] == alone[:2] and alone[2] not in single
    pair = SamplingParams(**greedy, bad_words_token_ids=[alone[1:3]])  # its second token, after its first
    rid = engine.add_request(PROMPT, pair)
    other = engine.add_request(PROMPT, SamplingParams(**greedy))  # a row beside it without bad words
    tokens: dict[str, list[int]] = {rid: [], other: []}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    assert tokens[rid][:2] == alone[:2] and tokens[rid][2] != alone[2]
    assert all(tokens[rid][k:k + 2] != alone[1:3] for k in range(7))
    assert tokens[other] == alone


def test_min_p_one_is_greedy_and_penalties_change_the_output(llama):
    engine, _ = llama
    greedy = run(engine, PROMPT, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    cut = run(engine, PROMPT, SamplingParams(max_tokens=12, temperature=1.5, min_p=1.0, seed=3, ignore_eos=True))
    assert [o.new_token_ids for o in cut] == [o.new_token_ids for o in greedy]
    penalised = run(engine, PROMPT, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                                   frequency_penalty=2.0, presence_penalty=2.0))
    tokens = [o.new_token_ids[0] for o in penalised]
    assert len(set(tokens)) > len({o.new_token_ids[0] for o in greedy}) or len(set(tokens)) == 12


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_logprobs_match_transformers(llama, temperature):
    engine, hf = llama
    params = SamplingParams(max_tokens=6, temperature=temperature, seed=5, ignore_eos=True, logprobs=3,
                            prompt_logprobs=2)
    outs = run(engine, PROMPT, params)
    tokens = [o.new_token_ids[0] for o in outs]
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT + tokens])).logits[0].float()
    for step, out in enumerate(outs):  # (the default mode, vLLM's: raw, whatever the temperature)
        [lp] = out.logprobs
        expected = ref[len(PROMPT) - 1 + step].log_softmax(-1)
        assert lp.token_id == tokens[step]
        assert lp.logprob == pytest.approx(expected[lp.token_id].item(), abs=1e-4)
        assert lp.rank == int((expected > expected[lp.token_id]).sum()) + 1
        top = expected.topk(3)
        assert [t for t, _ in lp.top] == top.indices.tolist()
        assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), abs=1e-4)
    prompt_lps = outs[0].prompt_logprobs
    assert len(prompt_lps) == len(PROMPT) and prompt_lps[0] is None
    expected = ref[:len(PROMPT) - 1].log_softmax(-1)
    for pos in range(1, len(PROMPT)):
        lp = prompt_lps[pos]
        assert lp.token_id == PROMPT[pos] and len(lp.top) == 2
        assert lp.logprob == pytest.approx(expected[pos - 1, PROMPT[pos]].item(), abs=1e-4)
    assert all(o.prompt_logprobs is None for o in outs[1:])


@pytest.mark.parametrize("mode", ["raw_logits", "processed_logprobs", "processed_logits"])
def test_logprobs_modes(llama_checkpoint, mode):
    """vLLM's --logprobs-mode: raw values ignore the penalties and the temperature; processed ones are those sampled
    from (penalised, divided by the temperature, top-k cut: a cut token reads -9999.0); prompt values stay raw."""
    path, hf = llama_checkpoint
    engine = build_engine(Config.flat(model=path, num_gpu_blocks_override=64, logprobs_mode=mode))
    params = SamplingParams(max_tokens=4, temperature=0.7, top_k=5, seed=5, ignore_eos=True, logprobs=8,
                            prompt_logprobs=1, frequency_penalty=1.5)
    outs = run(engine, PROMPT, params)
    tokens = [o.new_token_ids[0] for o in outs]
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT + tokens])).logits[0].float()
    for step, out in enumerate(outs):
        [lp] = out.logprobs
        values = ref[len(PROMPT) - 1 + step]
        if mode.startswith("processed"):
            values = _reference_penalties(values, PROMPT, tokens[:step], params) / 0.7
            values = values.masked_fill(values < values.topk(5).values[-1], float("-inf"))
        if mode.endswith("logprobs"):
            values = values.log_softmax(-1)
        assert lp.token_id == tokens[step]
        assert lp.logprob == pytest.approx(values[lp.token_id].item(), abs=1e-3)
        assert [t for t, _ in lp.top][:5] == values.topk(5).indices.tolist()
        assert [v for _, v in lp.top] == pytest.approx(values.topk(8).values.clamp(min=-9999.0).tolist(), abs=1e-3)
        # a logits mode still carries the token's log-probability, which best_of ranks candidates by
        expected = values.log_softmax(-1)[lp.token_id].item() if mode.endswith("logits") else lp.logprob
        assert lp.log_probability == pytest.approx(expected, abs=1e-3)
    prompt_values = ref[:len(PROMPT) - 1]
    if mode.endswith("logprobs"):
        prompt_values = prompt_values.log_softmax(-1)
    got = [lp.logprob for lp in outs[0].prompt_logprobs[1:]]
    assert got == pytest.approx([prompt_values[p - 1, PROMPT[p]].item() for p in range(1, len(PROMPT))], abs=1e-3)


def test_raw_logprobs_of_a_constrained_request_are_over_what_its_grammar_allows(text_checkpoint):
    """As vLLM's: a grammar's mask comes before raw logprobs are taken (a token it forbids reads -9999.0), so they
    are renormalised over the tokens it allows; the temperature still does not count."""
    pytest.importorskip("xgrammar")
    engine = build_engine(Config.flat(model=text_checkpoint, max_model_len=256, num_gpu_blocks_override=64))
    params = SamplingParams(max_tokens=4, temperature=0.8, seed=3, logprobs=20,
                            grammar=GrammarSpec("regex", "(yes|no)"))
    outs = run(engine, "Answer", params)
    assert "".join(engine.tokenizer.decode([o.new_token_ids[0]]) for o in outs) in ("yes", "no")
    for out in outs[:-1]:  # (the last is the end of the text, the grammar's only token left)
        [lp] = out.logprobs
        allowed = [v for _, v in lp.top if v > -9999.0]
        assert 0 < len(allowed) < 20 and lp.logprob > -9999.0
        assert sum(math.exp(v) for v in allowed) == pytest.approx(1.0, abs=1e-3)


def test_best_of_ranks_by_log_probability_in_every_mode():
    from appliance.server.formatting import Choice, best

    def candidates(values):
        choices = [Choice(i) for i in range(len(values))]
        for c, (logprob, likelihood) in zip(choices, values):
            c.logprobs = [TokenLogprob(1, logprob, 1, (), likelihood)] * 2
        return choices

    # a `_logits` mode: logits that would rank the candidates the other way round
    ranked = best(candidates([(9.0, -3.0), (5.0, -0.5), (7.0, -1.0)]), 2, 3)
    assert [c.logprobs[0].likelihood for c in ranked] == [-0.5, -1.0] and [c.index for c in ranked] == [0, 1]
    ranked = best(candidates([(-3.0, None), (-0.5, None), (-1.0, None)]), 1, 3)  # a logprobs mode
    assert [c.logprobs[0].logprob for c in ranked] == [-0.5]


def test_logprobs_mode_must_be_known():
    with pytest.raises(ConfigError, match="--logprobs-mode must be one of raw_logprobs, raw_logits"):
        Config.flat(logprobs_mode="raw")


def test_prompt_logprobs_bypass_the_prefix_cache_and_survive_chunking(llama_checkpoint):
    path, hf = llama_checkpoint
    engine = build_engine(Config.flat(model=path, num_gpu_blocks_override=64, policy="chunked", chunk_budget=16))
    run(engine, PROMPT, SamplingParams(max_tokens=1))  # the prompt's pages are now cached
    [out] = run(engine, PROMPT, SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0))
    assert out.num_cached_tokens == 0
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0].float().log_softmax(-1)
    got = [lp.logprob for lp in out.prompt_logprobs[1:]]
    assert got == pytest.approx([ref[p - 1, PROMPT[p]].item() for p in range(1, len(PROMPT))], abs=1e-4)
    assert engine.pool.num_free_pages == 64  # nothing leaked


@pytest.mark.parametrize("params, field", [
    (SamplingParams(min_p=1.5), "min_p"), (SamplingParams(min_tokens=20, max_tokens=4), "min_tokens"),
    (SamplingParams(presence_penalty=3), "presence_penalty"), (SamplingParams(frequency_penalty=-2.5),
                                                                "frequency_penalty"),
    (SamplingParams(repetition_penalty=0), "repetition_penalty"), (SamplingParams(logit_bias={5: 101}), "logit_bias"),
    (SamplingParams(logit_bias={10**6: 1}), "logit_bias"), (SamplingParams(logprobs=21), "logprobs"),
    (SamplingParams(allowed_token_ids=[]), "allowed_token_ids"),
    (SamplingParams(allowed_token_ids=[3, 10**6]), "allowed_token_ids"),
    (SamplingParams(bad_words=["x"]), "bad_words"),  # (this checkpoint has no tokenizer to spell it)
    (SamplingParams(bad_words_token_ids=[[3, 10**6]]), "bad_words"), (SamplingParams(bad_words_token_ids=[[]]),
                                                                       "bad_words_token_ids"),
    (SamplingParams(allowed_token_ids=[3, 4], bad_words_token_ids=[[3], [4]]), "allowed_token_ids"),
])
def test_bad_options_name_the_field(llama, params, field):
    engine, _ = llama
    with pytest.raises(RequestError) as info:
        engine.make_request(PROMPT, params)
    assert info.value.param == field


def test_min_tokens_with_stop_ids_outside_the_vocabulary(llama):
    engine, _ = llama
    outs = run(engine, PROMPT, SamplingParams(max_tokens=3, min_tokens=2, stop_token_ids=[2**62, 10**6]))
    assert len(outs) == 3 and outs[-1].finished  # the engine keeps running


def test_a_think_blocks_budget_forces_its_end_through_the_engine_loop(llama):
    """ThinkingLimit (vLLM's thinking_token_budget): the block opens where the output writes `start` (or at once),
    and once `budget` tokens were written inside it its end is forced token by token (a start of the end already
    written is continued); a block the model ends itself forces nothing; a row without a limit beside it is as
    alone."""
    engine, _ = llama
    greedy = dict(max_tokens=12, temperature=0, ignore_eos=True)
    alone = [o.new_token_ids[0] for o in run(engine, PROMPT, SamplingParams(**greedy))]
    spare = [t for t in range(engine.model.config.vocab_size) if t not in alone][:2]

    def tokens(limit: ThinkingLimit) -> tuple[list[int], list[int]]:
        rid = engine.add_request(PROMPT, SamplingParams(**greedy, thinking=limit))
        other = engine.add_request(PROMPT, SamplingParams(**greedy))
        out: dict[str, list[int]] = {rid: [], other: []}
        while engine.has_unfinished():
            for o in engine.step():
                out[o.request_id] += o.new_token_ids
        return out[rid], out[other]

    opened, beside = tokens(ThinkingLimit(3, start=tuple(alone[:2]), end=tuple(spare)))
    assert opened[:5] == alone[:5] and opened[5:7] == spare and beside == alone
    at_once, _ = tokens(ThinkingLimit(0, start=tuple(alone[:2]), end=tuple(spare), inside=True))
    assert at_once[:2] == spare
    natural, _ = tokens(ThinkingLimit(10, start=(spare[0],), end=(alone[3],), inside=True))
    assert natural == alone
    continued, _ = tokens(ThinkingLimit(3, start=(spare[0],), end=(alone[2], spare[1]), inside=True))
    assert continued[:4] == [*alone[:3], spare[1]]
