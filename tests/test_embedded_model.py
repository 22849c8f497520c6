"""The embedded default model: small enough to ship, loads with muxd, and answers a chat in recognisable text."""
from __future__ import annotations

from appliance.config import EMBEDDED_MODEL_DIR, Config
from appliance.engine.factory import build_engine
from appliance.engine.request import SamplingParams


def test_embedded_model_is_small_and_complete():
    files = {p.name for p in EMBEDDED_MODEL_DIR.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= files
    assert sum(p.stat().st_size for p in EMBEDDED_MODEL_DIR.iterdir()) < 15 * 2**20


def test_embedded_model_answers_in_words():
    engine = build_engine(Config())
    assert engine.model.config.architecture == "LlamaForCausalLM"
    tok = engine.tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What does len do?"}]),
                        add_special_tokens=False)
    [answer] = engine.generate(prompt, SamplingParams(max_tokens=64, temperature=0))
    assert answer.finish_reason == "stop"  # it ends its turn with <|end|>
    words = answer.text.split()
    letters = sum(c.isalpha() or c.isspace() or c in ".,'()" for c in answer.text)
    assert len(words) >= 3 and letters / len(answer.text) > 0.9, answer.text
