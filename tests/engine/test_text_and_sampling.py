"""Detokenization, stop conditions, request validation, sampling parameters and the async stream API."""
from __future__ import annotations

import asyncio
import json
import random
import shutil

import pytest

from appliance.config import EMBEDDED_MODEL_DIR, Config
from appliance.engine.async_engine import AsyncEngine
from appliance.engine import detokenizer as detok_module
from appliance.engine.detokenizer import Detokenizer
from appliance.engine.factory import build_engine
from appliance.engine.request import SamplingParams
from appliance.errors import CapacityError, RequestError
from appliance.model_zoo.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def engine(text_checkpoint):
    return build_engine(Config.flat(model=text_checkpoint, num_gpu_blocks_override=64, max_model_len=256))


def stream_text(detok: Detokenizer, ids: list[int]) -> tuple[list[str], bool]:
    pieces, hit = [], False
    for t in ids:
        hit = detok.push(t)
        pieces.append(detok.delta(finished=hit))
        if hit:
            break
    if not hit:
        detok.flush()
        pieces.append(detok.delta(finished=True))
    return pieces, hit


# The detokenizer's two paths give the same text: the tokenizers library's DecodeStream and the same algorithm in
# Python, over random token ids (byte pieces that split characters, special tokens shown and skipped, stop strings);
# a stream that fails on a token hands over to Python without a character lost or repeated.
needs_stream = pytest.mark.skipif(detok_module.DecodeStream is None, reason="tokenizers before 0.21: no DecodeStream")
STREAMED = []  # whether each run meant to use the stream did (a context ending inside a character does not)


def streamed(tok: Tokenizer, prompt: list[int], ids: list[int], stop: list[str], skip: bool,
             stream: bool) -> tuple[list[str], str, bool]:
    """(pieces streamed, the whole text, whether a stop string ended it) by the DecodeStream path or the Python one."""
    saved = detok_module.DecodeStream
    if not stream:
        detok_module.DecodeStream = None
    try:
        d = Detokenizer(tok, prompt, stop, skip_special_tokens=skip)
        if stream:
            STREAMED.append(d._stream is not None)
        else:
            assert d._stream is None
        pieces, hit = stream_text(d, ids)
        return pieces, d.text, hit
    finally:
        detok_module.DecodeStream = saved


@pytest.fixture(scope="module", params=["embedded", "text"])
def any_tokenizer(request, text_checkpoint):
    return Tokenizer(EMBEDDED_MODEL_DIR if request.param == "embedded" else text_checkpoint)


@needs_stream
def test_both_paths_stream_the_same_text(any_tokenizer):
    tok = any_tokenizer
    rng = random.Random(0)
    vocab = tok.vocab_size
    texts = ["Gr\u00fc\u00dfe aus K\u00f6ln \u65e5\u672c\u8a9e \U0001F600 done", "def f(x):\n    return x  # ok",
             "stop here STOP now"]
    cases = [tok.encode(t, add_special_tokens=False) for t in texts]
    cases += [[rng.randrange(vocab) for _ in range(rng.randrange(1, 60))] for _ in range(150)]
    special = sorted(tok.eos_token_ids)[0]
    for i, ids in enumerate(cases):
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 9))]
        if i % 4 == 1:  # a chat prompt may end with a special token, which a skipping stream holds back unseen
            prompt.append(special)
        stop = ["STOP"] if i % 3 == 0 else []
        skip = i % 2 == 0
        both = [streamed(tok, prompt, ids, stop, skip, stream) for stream in (True, False)]
        assert both[0] == both[1], (prompt, ids)
    assert sum(STREAMED[-len(cases):]) > len(cases) // 2  # (most through the stream)


@needs_stream
def test_a_stream_that_fails_hands_over_to_python_mid_text(any_tokenizer):
    tok = any_tokenizer
    text = "Gr\u00fc\u00dfe aus K\u00f6ln \u65e5\u672c\u8a9e \U0001F600 and more text"
    ids = tok.encode(text, add_special_tokens=False)
    expected = streamed(tok, [], ids, [], True, False)
    for fail_at in range(len(ids)):
        d = Detokenizer(tok, [], [])
        real, steps = d._stream, [0]

        class Failing:
            def step(self, raw, token):
                steps[0] += 1
                if steps[0] > fail_at:
                    raise Exception("the text no longer starts with its prefix")
                return real.step(raw, token)

        d._stream = Failing()
        pieces = []
        for t in ids:
            d.push(t)
            pieces.append(d.delta(finished=False))
        d.flush()
        pieces.append(d.delta(finished=True))
        assert "".join(pieces) == "".join(expected[0]) and d._stream is None


def test_incremental_detokenization_handles_multibyte_characters(text_checkpoint):
    tok = Tokenizer(text_checkpoint)
    text = "Gr\u00fc\u00dfe aus K\u00f6ln \u65e5\u672c\u8a9e \U0001F600 done"
    ids = tok.encode(text, add_special_tokens=False)
    pieces, hit = stream_text(Detokenizer(tok, tok.encode("Hello"), []), ids)
    assert not hit
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_stop_string_cuts_text_and_is_never_streamed(text_checkpoint):
    tok = Tokenizer(text_checkpoint)
    ids = tok.encode("stop here STOP now and then", add_special_tokens=False)
    pieces, hit = stream_text(Detokenizer(tok, [], ["STOP", "never"]), ids)
    assert hit
    assert "".join(pieces) == "stop here "
    assert not any("S" in p for p in pieces)


def test_stop_string_kept_with_include_stop_and_special_tokens_shown_when_asked(text_checkpoint):
    tok = Tokenizer(text_checkpoint)
    ids = tok.encode("stop here STOP now and then", add_special_tokens=False)
    pieces, hit = stream_text(Detokenizer(tok, [], ["never", "STOP", "here S"], include_stop=True), ids)
    assert hit and "".join(pieces) == "stop here S"  # the earliest match, kept
    special = sorted(tok.eos_token_ids)[:1]
    assert special, "the test checkpoint has an end-of-sequence token"
    shown, _ = stream_text(Detokenizer(tok, [], [], skip_special_tokens=False), ids[:2] + special)
    hidden, _ = stream_text(Detokenizer(tok, [], []), ids[:2] + special)
    assert "".join(shown) == "".join(hidden) + tok.decode(special, skip_special_tokens=False)


def test_a_long_output_keeps_only_the_stop_window_unsent(text_checkpoint):
    """A token's work does not grow with the output: the text not handed out yet, where stop strings are looked for,
    stays within the stop window and the latest piece, however long the output (the whole text is joined once, when
    asked for); a stop string that arrives after thousands of tokens still ends it, cut as usual."""
    tok = Tokenizer(text_checkpoint)
    ids = tok.encode("the quick brown fox jumps over the lazy dog and runs ", add_special_tokens=False) * 300
    tail = tok.encode("until the END of it", add_special_tokens=False)
    d = Detokenizer(tok, [], ["END", "never seen"])
    pieces, longest = [], 0
    for t in ids + tail:
        hit = d.push(t)
        pieces.append(d.delta(finished=hit))
        if hit:
            break
        longest = max(longest, len(d._held))
    assert hit and d.matched == "END"
    assert longest <= d.hold + max(len(tok.decode([t])) for t in ids + tail)
    assert "".join(pieces) == d.text == tok.decode(ids) + "until the "


def test_stop_strings_and_stop_token_ids_end_generation(engine):
    prompt = "The quick brown fox"
    free = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    [base] = engine.generate(prompt, free)
    assert base.finish_reason == "length" and len(base.token_ids) == 40
    # stop token id: the 6th generated token
    stop_tok = base.token_ids[5]
    [c] = engine.generate(prompt, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True,
                                                  stop_token_ids=[stop_tok]))
    first = base.token_ids.index(stop_tok)
    assert c.token_ids == base.token_ids[:first + 1] and c.finish_reason == "stop"
    # stop string: a piece of the unconstrained text
    text = base.text
    needle = text[len(text) // 2:len(text) // 2 + 3]
    if needle.strip():
        [s] = engine.generate(prompt, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=[needle]))
        assert s.finish_reason == "stop"
        assert s.text == text[:text.index(needle)]


def test_eos_from_generation_config_stops_unless_ignored(text_checkpoint, tmp_path, engine):
    [base] = engine.generate("import os", SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    eos = base.token_ids[3]
    d = shutil.copytree(text_checkpoint, tmp_path / "eos")
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, 1]}))
    e = build_engine(Config.flat(model=d, num_gpu_blocks_override=64))
    [c] = e.generate("import os", SamplingParams(max_tokens=12, temperature=0))
    assert c.finish_reason == "stop" and c.token_ids == base.token_ids[:base.token_ids.index(eos) + 1]
    [ignored] = e.generate("import os", SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert ignored.token_ids == base.token_ids


@pytest.mark.parametrize("params, field", [
    (dict(max_tokens=0), "max_tokens"), (dict(temperature=-0.5), "temperature"), (dict(top_p=0.0), "top_p"),
    (dict(top_k=-3), "top_k"), (dict(max_tokens=300), "max_tokens"), (dict(stop=[""]), "stop"),
    (dict(bad_words=[" \t"]), "bad_words"), (dict(bad_words=["x" * 129]), "bad_words"),
])
def test_bad_sampling_parameters_name_the_field(engine, params, field):
    with pytest.raises(RequestError) as info:
        engine.make_request("hello", SamplingParams(**params))
    assert info.value.param == field and field in str(info.value)


def test_bad_words_are_spelled_as_vllm_spells_them(engine, text_checkpoint):
    """Each word without its leading whitespace, and after a space where that is other tokens of the same length."""
    tok = Tokenizer(text_checkpoint)

    def ids(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    words = ("world", "the lazy dog", "and")
    request = engine.make_request("hello", SamplingParams(bad_words=["  " + w for w in words]))
    spellings = [[ids(w), ids(" " + w)] if ids(" " + w)[0] != ids(w)[0] and len(ids(" " + w)) == len(ids(w))
                 else [ids(w)] for w in words]
    assert request.sampling.bad_words_token_ids == [s for pair in spellings for s in pair]
    assert 3 < len(request.sampling.bad_words_token_ids) < 6  # (some words have both spellings, some one)


def test_bad_prompts(engine):
    with pytest.raises(RequestError, match="empty"):
        engine.make_request("", SamplingParams())
    with pytest.raises(RequestError, match="vocabulary"):
        engine.make_request([5, 10_000], SamplingParams())
    with pytest.raises(RequestError, match="context") as info:
        engine.make_request([5] * 256, SamplingParams(max_tokens=1))
    assert info.value.param == "prompt"


def test_waiting_queue_limit(text_checkpoint):
    """One free seat and two queue places: three requests in, the fourth refused."""
    e = build_engine(Config.flat(model=text_checkpoint, num_gpu_blocks_override=16, max_num_seqs=1, max_waiting=2))
    e.add_request("a"), e.add_request("b"), e.add_request("c")
    with pytest.raises(CapacityError, match="waiting"):
        e.add_request("d")


def test_sampling_seeded_reproducible_and_greedy_equivalents(engine):
    prompt = "def main"
    seeded = SamplingParams(max_tokens=16, temperature=1.0, seed=7, ignore_eos=True)
    [a] = engine.generate(prompt, seeded)
    # same seed inside a batch with other random requests: same tokens
    batch = engine.generate([prompt, "hello", prompt], [seeded, SamplingParams(max_tokens=16, temperature=1.0),
                                                       SamplingParams(max_tokens=16, temperature=1.0, seed=8,
                                                                      ignore_eos=True)])
    assert batch[0].token_ids == a.token_ids
    assert batch[2].token_ids != a.token_ids
    greedy = engine.generate(prompt, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0].token_ids
    top1 = engine.generate(prompt, SamplingParams(max_tokens=16, top_k=1, seed=3, ignore_eos=True))[0].token_ids
    tiny_p = engine.generate(prompt, SamplingParams(max_tokens=16, top_p=1e-6, seed=3, ignore_eos=True))[0].token_ids
    assert greedy == top1 == tiny_p


def test_async_stream_delivers_and_early_close_aborts(text_checkpoint):
    e = build_engine(Config.flat(model=text_checkpoint, num_gpu_blocks_override=64))
    total = e.pool.num_free_pages

    async def main():
        ae = AsyncEngine(e)
        ae.start()
        try:
            req = ae.make_request("hello", SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
            outs = [o async for o in ae.stream(req)]
            assert [len(o.new_token_ids) for o in outs] == [1] * 8
            assert outs[-1].finished and outs[-1].finish_reason == "length" and outs[-1].num_output_tokens == 8
            assert "".join(o.new_text for o in outs) == outs[-1].text
            long = ae.make_request("hello", SamplingParams(max_tokens=200, ignore_eos=True))
            agen = ae.stream(long)
            async for out in agen:
                if out.num_output_tokens == 3:
                    break
            await agen.aclose()
            for _ in range(200):
                if ae.stats["free_pages"] == total and ae.stats["num_running"] == 0:
                    break
                await asyncio.sleep(0.01)
            assert ae.stats["free_pages"] == total and not e.has_unfinished()
        finally:
            ae.shutdown()

    asyncio.run(main())
