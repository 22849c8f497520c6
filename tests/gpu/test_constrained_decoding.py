"""Structured output on CUDA: the token masks applied on the device keep every output inside its JSON schema, or its
structural tag (the embedded model, decode graphs on)."""
from __future__ import annotations

import json
import re

import pytest

from appliance.config import Config
from appliance.engine.factory import build_engine
from appliance.engine.grammar import GrammarSpec
from appliance.engine.request import SamplingParams

jsonschema = pytest.importorskip("jsonschema", reason="jsonschema (the test extra) validates the outputs")


@pytest.fixture(scope="module", autouse=True)
def needs_xgrammar():
    """xgrammar imported when the tests run: at collection it cost seconds on machines that skip them (no CUDA)."""
    pytest.importorskip("xgrammar", reason="structured output needs xgrammar")


SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b"]}, "maxItems": 3},
    "address": {"type": "object", "properties": {"zip": {"type": "integer", "minimum": 0, "maximum": 99999}},
                "required": ["zip"], "additionalProperties": False}},
    "required": ["name", "age", "tags", "address"], "additionalProperties": False}


def test_schema_outputs_validate_on_cuda():
    engine = build_engine(Config.flat(model="embedded", device="cuda", max_model_len=1024, max_num_seqs=32))
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    params = [SamplingParams(max_tokens=200, temperature=1.0, seed=s, grammar=spec) for s in range(32)]
    outs = engine.generate(["<|user|>\nA person as JSON.<|end|>\n<|assistant|>\n"] * 32, params)
    for out in outs:
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), SCHEMA)
    tag = {"type": "structural_tag", "format": {"type": "tag", "begin": "<w>", "end": "</w>",
                                                "content": {"type": "regex", "pattern": "[0-9]{3}-[a-c]{2}"}}}
    spec = GrammarSpec("structural_tag", json.dumps(tag))
    params = [SamplingParams(max_tokens=40, temperature=1.0, seed=s, grammar=spec) for s in range(8)]
    for out in engine.generate(["<|user|>\nA code.<|end|>\n<|assistant|>\n"] * 8, params):
        assert out.finish_reason == "stop" and re.fullmatch("<w>[0-9]{3}-[a-c]{2}</w>", out.text), out.text
    assert engine.pool.num_free_pages == engine.pool.num_pages
