"""Property-based fuzzing of what users hand muxd: config.json (ModelConfig), the SLO contract YAML, request bodies
(the pydantic protocol, chat and Responses), chat templates and messages, and the tokenizer. Each may succeed or fail
with muxd's own error naming what is wrong, never with anything else. The `reliability` hypothesis profile
(tests/conftest.py; scripts/reliability.py fuzz) runs many more cases than the default `ci` one.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from appliance.config import EMBEDDED_MODEL_DIR
from appliance.errors import ApplianceError, ContractError, RequestError
from appliance.model_zoo.chat_template import compile_chat_template
from appliance.model_zoo.config import ModelConfig
from appliance.model_zoo.tokenizer import Tokenizer
from appliance.server.protocol import ChatCompletionRequest, bodies_for
from appliance.server.responses_api import ResponsesRequest
from appliance.slo.contract import Contract, parse_contract

JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner,
                                                                              max_size=4), max_leaves=12)
BASE = json.loads((EMBEDDED_MODEL_DIR / "config.json").read_text())
CONFIG_KEYS = sorted(BASE) + ["rope_scaling", "rope_parameters", "head_dim", "architectures", "use_sliding_window",
                               "sliding_window", "partial_rotary_factor", "text_config"]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(EMBEDDED_MODEL_DIR)


@pytest.fixture(scope="module")
def retemplated() -> Tokenizer:
    """A tokenizer whose template the tests replace."""
    return Tokenizer(EMBEDDED_MODEL_DIR)


@given(edits=st.dictionaries(st.sampled_from(CONFIG_KEYS), JSON, max_size=4))
def test_config_json_with_random_fields_loads_or_says_what_is_wrong(tmp_path_factory, edits):
    path = tmp_path_factory.mktemp("cfg") / "config.json"
    path.write_text(json.dumps({**BASE, **edits}, allow_nan=True))
    try:
        cfg = ModelConfig.from_file(path)
    except ApplianceError as exc:
        assert str(exc)
    else:
        assert cfg.num_layers >= 1 and cfg.vocab_size >= 1


@given(raw=st.binary(max_size=200) | JSON.map(lambda v: json.dumps(v, allow_nan=True).encode()))
def test_config_json_that_is_not_a_config_is_refused_cleanly(tmp_path_factory, raw):
    path = tmp_path_factory.mktemp("cfg") / "config.json"
    path.write_bytes(raw)
    with pytest.raises(ApplianceError):
        ModelConfig.from_file(path)


CONTRACT = yaml.safe_load((Path(__file__).resolve().parents[1] / "configs" / "slo" / "chat.yaml").read_text())


def _edit(doc: dict, path: list[str], value) -> dict:
    """A copy of doc with `value` put at `path` (missing levels created, scalars replaced)."""
    out = json.loads(json.dumps(doc))
    node = out
    for key in path[:-1]:
        if not isinstance(node.get(key), dict):
            node[key] = {}
        node = node[key]
    node[path[-1]] = value
    return out


SLO_KEYS = st.sampled_from(["version", "name", "attainment", "targets", "ttft", "tbt", "ms", "percentile",
                            "per_1k_tokens_ms", "classes", "interactive", "priority", "default_class", "overload",
                            "mode", "queue_limit", "tpot", "e2e", "x"])


@given(edits=st.lists(st.tuples(st.lists(SLO_KEYS, min_size=1, max_size=4), JSON), max_size=3))
def test_slo_contract_with_random_edits_loads_or_lists_its_problems(edits):
    doc = CONTRACT
    for path, value in edits:
        doc = _edit(doc, path, value)
    text = yaml.safe_dump(doc, allow_unicode=True)
    try:
        contract = parse_contract(text, "contract.yaml")
    except ContractError as exc:
        assert exc.problems and all(p.message and p.line >= 0 for p in exc.problems)
    else:
        assert isinstance(contract, Contract) and contract.classes


@given(text=st.text(max_size=300))
def test_any_text_as_slo_contract_is_a_contract_or_a_contract_error(text):
    try:
        parse_contract(text, "contract.yaml")
    except ContractError as exc:
        assert exc.problems


FIELDS = ["model", "prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream",
          "stream_options", "n", "logprobs", "tools", "response_format", "user", "stop_token_ids", "slo_class",
          "truncate_prompt_tokens", "prompt_logprobs", "return_tokens_as_token_ids", "priority", "echo", "min_tokens",
          "chat_template_kwargs", "reasoning_effort", "metadata", "include_reasoning", "unknown"]
RESPONSES_FIELDS = ["model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "stream", "text",
                    "reasoning", "tools", "tool_choice", "previous_response_id", "include", "truncation", "metadata",
                    "slo_class", "unknown"]
ITEM = st.fixed_dictionaries({"type": st.sampled_from(["message", "function_call", "function_call_output",
                                                       "reasoning", "web_search_call"]),
                              "role": st.sampled_from(["user", "assistant", "tool"]), "content": JSON,
                              "call_id": JSON, "name": JSON, "arguments": JSON, "output": JSON})


@given(body=st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=6), chat=st.booleans())
def test_any_json_body_validates_or_is_a_clean_error(body, chat):
    completion, chat_request = bodies_for(4096, ["default", "batch"])
    model = chat_request if chat else completion
    try:
        request = model.model_validate(body)
    except (ValidationError, RequestError):
        return
    try:
        params = request.sampling_params(16)  # (16 tokens left by the context, as the server passes when no max)
    except RequestError as exc:
        assert exc.param == "min_tokens"  # more than the context leaves: the only late refusal
        return
    params.validate()  # what the protocol accepts, the engine accepts too


@given(body=st.dictionaries(st.sampled_from(RESPONSES_FIELDS), JSON, max_size=6),
       items=st.lists(ITEM.map(lambda item: {k: v for k, v in item.items() if v is not None}), max_size=3))
def test_any_responses_body_runs_as_a_chat_request_or_is_a_clean_error(body, items):
    """/v1/responses bodies: valid ones become chat requests whose sampling the engine takes; the rest fail naming
    what is wrong."""
    _, chat_request = bodies_for(4096, ["default", "batch"])
    if items:
        body = {**body, "input": items}
    try:
        chat = ResponsesRequest.model_validate(body).to_chat(chat_request)
    except (ValidationError, RequestError):
        return
    chat.sampling_params(16).validate()


TEXT = st.text(alphabet=st.characters(codec="utf-8"), max_size=40)
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "tool", "developer"]),
                                 "content": TEXT | st.lists(st.fixed_dictionaries(
                                     {"type": st.just("text"), "text": TEXT}), max_size=3) | st.none()})


@given(messages=st.lists(MESSAGE, min_size=1, max_size=5))
def test_chat_messages_render_and_tokenize(tokenizer, messages):
    request = ChatCompletionRequest.model_validate({"messages": messages})
    text = tokenizer.apply_chat_template([m.for_template() for m in request.messages])
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.min_tokens(text) <= len(ids)  # the bound used to refuse huge prompts early is a bound
    assert all(0 <= t < tokenizer.vocab_size for t in ids)


@given(text=st.text(alphabet=st.characters(codec="utf-8"), max_size=300))
def test_min_tokens_never_exceeds_the_real_count(tokenizer, text):
    assert tokenizer.min_tokens(text) <= len(tokenizer.encode(text))


PIECES = ["{{ ", " }}", "{% ", " %}", "for m in messages", "endfor", "if", "endif", "m['content']", "m.role",
          "raise_exception('no')", "bos_token", "|trim", "messages[0]", "x", "\n", "{#", "#}", "loop.index",
          "range(3)", "messages|length", "m['missing']['deeper']", "1/0", "strftime_now('%Y')", "[", "]"]


@given(source=st.lists(st.sampled_from(PIECES), max_size=14).map("".join),
       messages=st.lists(MESSAGE, min_size=1, max_size=3))
def test_any_chat_template_compiles_and_renders_or_is_a_clean_error(retemplated, source, messages):
    try:
        compile_chat_template(source)
    except ApplianceError:
        return
    retemplated.set_chat_template(source)
    try:
        out = retemplated.apply_chat_template(messages)
    except RequestError as exc:
        assert exc.param == "messages"
    else:
        assert isinstance(out, str)


def test_template_errors_are_named(retemplated):
    with pytest.raises(ApplianceError, match="syntax error on line 1"):
        compile_chat_template("{% for m in messages %}")
    retemplated.set_chat_template("{{ 1 / 0 }}")
    with pytest.raises(RequestError, match="ZeroDivisionError"):
        retemplated.apply_chat_template([{"role": "user", "content": "x"}])


def test_control_character_in_a_contract_is_a_located_problem():
    with pytest.raises(ContractError, match=r"contract.yaml:2: not valid YAML: character U\+001F"):
        parse_contract("version: 1\nname: \x1f\n", "contract.yaml")
