"""The detokenizer's two paths give the same text: the tokenizers library's DecodeStream and the same algorithm in
Python, over random token ids (byte pieces that split characters, special tokens shown and skipped, stop strings),
and a stream that fails on a token hands over to Python without a character lost or repeated."""
from __future__ import annotations

import random

import pytest

from appliance.config import EMBEDDED_MODEL_DIR
from appliance.engine import detokenizer as detok_module
from appliance.engine.detokenizer import Detokenizer
from appliance.model_zoo.tokenizer import Tokenizer

pytestmark = pytest.mark.skipif(detok_module.DecodeStream is None, reason="tokenizers before 0.21: no DecodeStream")


STREAMED = []  # whether each run meant to use the stream did (a context ending inside a character does not)


def run(tok: Tokenizer, prompt: list[int], ids: list[int], stop: list[str], skip: bool,
        stream: bool) -> tuple[list[str], str, bool]:
    saved = detok_module.DecodeStream
    if not stream:
        detok_module.DecodeStream = None
    try:
        d = Detokenizer(tok, prompt, stop, skip_special_tokens=skip)
        if stream:
            STREAMED.append(d._stream is not None)
        else:
            assert d._stream is None
        pieces, hit = [], False
        for t in ids:
            hit = d.push(t)
            pieces.append(d.delta(finished=hit))
            if hit:
                break
        if not hit:
            d.flush()
            pieces.append(d.delta(finished=True))
        return pieces, d.text, hit
    finally:
        detok_module.DecodeStream = saved


@pytest.fixture(scope="module", params=["embedded", "text"])
def tok(request, text_checkpoint):
    return Tokenizer(EMBEDDED_MODEL_DIR if request.param == "embedded" else text_checkpoint)


def test_both_paths_stream_the_same_text(tok):
    rng = random.Random(0)
    vocab = tok.vocab_size
    texts = ["Gr\u00fc\u00dfe aus K\u00f6ln \u65e5\u672c\u8a9e \U0001F600 done", "def f(x):\n    return x  # ok",
             "stop here STOP now"]
    cases = [tok.encode(t, add_special_tokens=False) for t in texts]
    cases += [[rng.randrange(vocab) for _ in range(rng.randrange(1, 60))] for _ in range(150)]
    for i, ids in enumerate(cases):
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 9))]
        stop = ["STOP"] if i % 3 == 0 else []
        skip = i % 2 == 0
        assert run(tok, prompt, ids, stop, skip, True) == run(tok, prompt, ids, stop, skip, False), (prompt, ids)
    assert sum(STREAMED[-len(cases):]) > len(cases) // 2  # (most through the stream)


def test_a_stream_that_fails_hands_over_to_python_mid_text(tok, monkeypatch):
    text = "Gr\u00fc\u00dfe aus K\u00f6ln \u65e5\u672c\u8a9e \U0001F600 and more text"
    ids = tok.encode(text, add_special_tokens=False)
    expected = run(tok, [], ids, [], True, False)
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
