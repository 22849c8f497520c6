"""Prompt synthesis: exact token lengths under the served tokenizer, token-id prompts without one, and Mooncake
hash ids (and a synthetic workload's shared prefix) turned into shared token prefixes."""
from __future__ import annotations

from pathlib import Path

import pytest

from appliance.bench.prompts import PromptSynth
from appliance.config import EMBEDDED_MODEL_DIR
from appliance.errors import ConfigError
from appliance.model_zoo.tokenizer import Tokenizer
from appliance.workload.shaping import LengthDist, clip_to_context, synthetic
from appliance.workload.traces import RequestSpec, load_azure, load_mooncake

DATA = Path(__file__).resolve().parents[1] / "data"
DUMMY = Path(__file__).resolve().parents[2] / "configs" / "models" / "llama-3.1-8b"


@pytest.fixture(scope="module")
def synth() -> PromptSynth:
    return PromptSynth.from_model_dir(EMBEDDED_MODEL_DIR)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def shared_blocks(a: RequestSpec, b: RequestSpec) -> int:
    return common_prefix(list(a.hash_ids), list(b.hash_ids))


def test_text_prompts_have_the_exact_token_count(synth):
    specs, _ = clip_to_context(load_azure(DATA / "azure_code_2023_head200.csv")[:60], 2048)
    tok = Tokenizer(EMBEDDED_MODEL_DIR)
    for i, spec in enumerate(specs):
        prompt = synth.prompt(spec, i)
        assert isinstance(prompt, str)
        assert len(tok.encode(prompt)) == spec.prompt_len  # as the server counts it: BOS included
    assert synth.inexact == 0
    # seeded per request: the same request gets the same prompt, another request another one
    assert synth.prompt(specs[3], 3) == PromptSynth.from_model_dir(EMBEDDED_MODEL_DIR).prompt(specs[3], 3)
    assert synth.prompt(specs[3], 3) != synth.prompt(specs[3], 4)


def test_mooncake_hash_prefixes_become_token_prefixes(synth):
    specs, _ = clip_to_context(load_mooncake(DATA / "mooncake_conversation_head200.jsonl"), 3072)
    tokens = [synth.token_ids(s, i) for i, s in enumerate(specs)]
    assert [len(t) for t in tokens] == [s.prompt_len for s in specs]
    special = synth.num_special
    checked = deep = 0
    for i in range(len(specs)):
        for j in range(i + 1, len(specs)):
            k = shared_blocks(specs[i], specs[j])
            if k == 0:
                continue
            want = min(special + k * 512, len(tokens[i]), len(tokens[j]))
            assert tokens[i][:want] == tokens[j][:want], (i, j, k)
            if k < min(len(specs[i].hash_ids), len(specs[j].hash_ids)):  # the next blocks differ
                assert tokens[i][want:want + 512] != tokens[j][want:want + 512]
            checked += 1
            deep += k >= 2
    assert checked > 100 and deep >= 5  # the slice has multi-turn reuse beyond the shared system block
    # another salt (the next point of a sweep): the sharing pattern stays, the tokens change
    salted = [synth.token_ids(s, i, salt=1) for i, s in enumerate(specs[:2])]
    assert salted[0][:special + 512] == salted[1][:special + 512]
    assert salted[0][special:special + 512] != tokens[0][special:special + 512]


def test_token_id_prompts_for_models_without_tokenizer():
    synth = PromptSynth.from_model_dir(DUMMY)
    assert not synth.uses_text
    a = RequestSpec(0, 1000, 4, hash_ids=(7, 8), block_size=512)
    b = RequestSpec(0, 700, 4, hash_ids=(7, 9), block_size=512)
    pa, pb = synth.prompt(a, 0), synth.prompt(b, 1)
    assert (len(pa), len(pb)) == (1000, 700)
    assert all(isinstance(t, int) and 16 <= t < 128256 for t in pa)
    assert pa[:512] == pb[:512] and pa[512:700] != pb[512:700]
    plain = synth.prompt(RequestSpec(0, 33, 1), 5)
    assert len(plain) == 33 and plain != synth.prompt(RequestSpec(0, 33, 1), 6)


def test_recorded_text_is_sent_as_is(synth):
    assert synth.prompt(RequestSpec(0, 3, 2, prompt="def f(x):"), 0) == "def f(x):"


def test_bad_model_dirs(tmp_path):
    with pytest.raises(ConfigError, match="neither tokenizer.json nor config.json"):
        PromptSynth.from_model_dir(tmp_path)
    (tmp_path / "config.json").write_text('{"vocab_size": "big"}')
    with pytest.raises(ConfigError, match="vocab_size must be an integer"):
        PromptSynth.from_model_dir(tmp_path)


def test_a_random_prefix_is_shared_by_every_synthetic_prompt(synth):
    """vLLM's --random-prefix-len: one prefix of P tokens, then each prompt's own tokens."""
    specs = synthetic(6, 2.0, LengthDist.parse("uniform:20:300"), LengthDist.parse("8"), prefix_len=64)
    plain = synthetic(6, 2.0, LengthDist.parse("uniform:20:300"), LengthDist.parse("8"))
    assert [s.prompt_len for s in specs] == [64 + s.prompt_len for s in plain]
    assert all(s.block_size == 64 and s.hash_ids[0] == 0 for s in specs)
    own = [set(s.hash_ids[1:]) for s in specs]
    assert all(not (own[i] & own[j]) for i in range(6) for j in range(i + 1, 6))  # nothing else shared
    tokens = [synth.token_ids(s, i) for i, s in enumerate(specs)]
    assert [len(t) for t in tokens] == [s.prompt_len for s in specs]
    head = synth.num_special + 64
    assert all(t[:head] == tokens[0][:head] for t in tokens)
    assert len({tuple(t[head:head + 16]) for t in tokens}) == 6
    with pytest.raises(ConfigError, match="--random-prefix-len"):
        synthetic(2, 1.0, LengthDist.parse("8"), LengthDist.parse("8"), prefix_len=-1)
