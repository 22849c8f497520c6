"""Structured output and forced tool calls against a real `muxd serve` with the embedded model: every output of a
nested JSON schema validates (jsonschema), streamed or not; tool_choice "required" and a named function give calls
whose arguments follow the function's parameters."""
from __future__ import annotations

import json

import jsonschema
import pytest

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "maxItems": 3},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                 "zip": {"type": "integer", "minimum": 0, "maximum": 99999}},
                "required": ["city", "zip"], "additionalProperties": False},
    "active": {"type": "boolean"}}, "required": ["name", "age", "tags", "address", "active"],
    "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"type": "string", "enum": ["C", "F"]}},
           "required": ["city", "unit"], "additionalProperties": False}
UNIT = {"type": "string", "enum": ["C", "F"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
             "required": ["zone"], "additionalProperties": False}}}]
ASK = [{"role": "user", "content": "Describe a person as JSON."}]


@pytest.fixture(scope="module")
def server(shared_serve):
    return shared_serve("--kv-cache-memory", "64MiB", "--max-model-len", "512")  # the API tests' server




def test_nested_json_schema_outputs_all_validate(client, model_name):
    out = client.chat.completions.create(
        model=model_name, messages=ASK, n=4, seed=0, temperature=1.0, max_tokens=200,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    assert len(out.choices) == 4
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    stream = client.chat.completions.create(
        model=model_name, messages=ASK, seed=1, temperature=1.0, max_tokens=200, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), PERSON)


def test_completions_take_response_format_too(client, model_name):
    """As vLLM's completions do: json_schema and json_object; one constraint a request."""
    out = client.completions.create(model=model_name, prompt="A person as JSON: ", n=2, seed=3, max_tokens=200,
                                    extra_body={"response_format": {"type": "json_schema", "json_schema": {
                                        "name": "person", "schema": PERSON}}})
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.text), PERSON)
    out = client.completions.create(model=model_name, prompt="JSON: ", seed=4, max_tokens=200,
                                    extra_body={"response_format": {"type": "json_object"}})
    if out.choices[0].finish_reason == "stop":  # (a random tiny model may write one string until max_tokens)
        assert isinstance(json.loads(out.choices[0].text), dict)


def test_json_object(client, model_name):
    out = client.chat.completions.create(model=model_name, messages=ASK, n=4, seed=2, max_tokens=200,
                                         response_format={"type": "json_object"})
    finished = [c for c in out.choices if c.finish_reason == "stop"]
    assert finished  # a random tiny model may write one long string until max_tokens; most close their object
    for choice in finished:
        assert isinstance(json.loads(choice.message.content), dict)


def test_tool_choice_required_and_named(client, model_name):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    out = client.chat.completions.create(model=model_name, messages=ask, tools=TOOLS, tool_choice="required",
                                         parallel_tool_calls=False, max_tokens=200, seed=3)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    for call in choice.message.tool_calls:
        schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), schema)
        assert call.id.startswith("call_") and call.type == "function"
    named = {"type": "function", "function": {"name": "get_weather"}}
    out = client.chat.completions.create(model=model_name, messages=ask, tools=TOOLS, tool_choice=named,
                                         max_tokens=200, seed=4)
    [call] = out.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and out.choices[0].message.content is None
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    stream = client.chat.completions.create(model=model_name, messages=ask, tools=TOOLS, tool_choice=named,
                                            max_tokens=200, seed=4, stream=True)
    deltas = [d for c in stream if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert deltas[0].function.name == "get_weather" and deltas[0].id.startswith("call_")
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments


def test_required_calls_stream_as_they_are_written_and_a_cut_keeps_them(client, model_name):
    """tool_choice "required" streams each call's name once written, then its arguments as they come (as the whole
    answer has them); cut short by max_tokens, the calls written so far come back, the last one's arguments cut,
    ending as "length" (as OpenAI's)."""
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    common = dict(model=model_name, messages=ask, tools=TOOLS, tool_choice="required", seed=7, temperature=1.0)
    whole = client.chat.completions.create(**common, max_tokens=200)
    [call, *more] = whole.choices[0].message.tool_calls
    stream = client.chat.completions.create(**common, max_tokens=200, stream=True)
    chunks = [c for c in stream if c.choices]
    deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
    assert deltas[0].function.name == call.function.name and deltas[0].id.startswith("call_")
    assert len([d for d in deltas if d.index == 0]) > 2  # the arguments came in pieces, not at the end
    assert "".join(d.function.arguments or "" for d in deltas if d.index == 0) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    for cut in range(whole.usage.completion_tokens - 1, 0, -1):  # the longest cut inside the first arguments
        short = client.chat.completions.create(**common, max_tokens=cut).choices[0]
        if more or short.message.tool_calls[0].function.arguments != call.function.arguments:
            break
    assert short.finish_reason == "length" and short.message.tool_calls[0].function.name == call.function.name
    assert call.function.arguments.startswith(short.message.tool_calls[0].function.arguments)
    stream = client.chat.completions.create(**common, max_tokens=cut, stream=True)
    chunks = [c for c in stream if c.choices]
    streamed = "".join(d.function.arguments or "" for c in chunks for d in c.choices[0].delta.tool_calls or []
                       if d.index == 0)
    assert streamed == short.message.tool_calls[0].function.arguments
    assert chunks[-1].choices[0].finish_reason == "length"


def test_tools_with_auto_choice_on_a_model_without_a_call_format(client, model_name):
    out = client.chat.completions.create(model=model_name, messages=ASK, tools=TOOLS, max_tokens=8, seed=5)
    assert out.choices[0].message.content and not out.choices[0].message.tool_calls
    none = client.chat.completions.create(model=model_name, messages=ASK, tools=TOOLS, tool_choice="none",
                                          max_tokens=8, seed=5)
    assert none.choices[0].finish_reason in ("stop", "length")


def test_vllm_guided_fields_constrain_the_output(client, model_name, server):
    """vLLM's guided_json, guided_regex, guided_choice (and structured_outputs) on completions and chat; more than one
    constraint, or one the compiler cannot use, is a 400 naming the field."""
    import re

    import httpx

    kw = dict(model=model_name, prompt="x", n=3, seed=4, temperature=1.0, max_tokens=40)
    choices = client.completions.create(**kw, extra_body={"guided_choice": ["red", "green", "blue"]}).choices
    assert {c.text for c in choices} <= {"red", "green", "blue"} and all(c.finish_reason == "stop" for c in choices)
    for c in client.completions.create(**kw, extra_body={"guided_regex": "[0-9]{3}-[a-c]+"}).choices:
        assert re.fullmatch("[0-9]{3}-[a-c]+", c.text) or c.finish_reason == "length", c.text
    for c in client.completions.create(**{**kw, "max_tokens": 200}, extra_body={"guided_json": WEATHER}).choices:
        if c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.text), WEATHER)
    chat = client.chat.completions.create(model=model_name, messages=ASK, max_tokens=10,
                                          extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert chat.choices[0].message.content in ("yes", "no")
    for body, param in (({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
                        ({"guided_regex": "[0-9"}, "guided_regex"),
                        ({"guided_json": "{not json"}, "guided_json"),
                        ({"structured_outputs": {}}, "structured_outputs"),
                        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex")):
        response = httpx.post(server.url + "/v1/completions", json={"prompt": "x", **body}, timeout=120)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    response = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
        "messages": ASK, "guided_regex": "a", "response_format": {"type": "json_object"}})
    assert response.status_code == 400 and response.json()["error"]["param"] == "guided_regex", response.text


def test_structural_tags_as_vllm_takes_them(client, model_name, server, served_dir):
    """vLLM's structural_tag: xgrammar's form (`format`) in response_format holds the whole output to its tag; the
    older form (structures and triggers, in structured_outputs as JSON text) leaves the text free and holds every
    structure a trigger opens to its begin, schema and end. A tag the compiler cannot use is a 400 naming the field."""
    import re

    import httpx

    from appliance.model_zoo.tokenizer import Tokenizer

    tagged = {"type": "structural_tag", "format": {"type": "tag", "begin": "<w>", "end": "</w>", "content": {
        "type": "regex", "pattern": "[0-9]{3}-[a-c]{2}"}}}
    out = client.chat.completions.create(model=model_name, messages=ASK, n=3, seed=5, temperature=1.0, max_tokens=40,
                                         response_format=tagged)
    for choice in out.choices:
        assert choice.finish_reason == "stop" and re.fullmatch("<w>[0-9]{3}-[a-c]{2}</w>", choice.message.content), \
            choice.message.content
    # the older form: the trigger's token made likely, so that the output opens structures
    trigger = Tokenizer(served_dir).encode("<", add_special_tokens=False)
    legacy = {"structures": [{"begin": "<f=w>", "schema": UNIT, "end": "</f>"}], "triggers": ["<"]}
    out = client.completions.create(model=model_name, prompt="x", n=2, seed=6, temperature=1.0, max_tokens=100,
                                    logit_bias={str(t): 100 for t in trigger},
                                    extra_body={"structured_outputs": {"structural_tag": json.dumps(legacy)}})
    for choice in out.choices:
        opened = choice.text.split("<f=")[1:]
        # every "<" begins or ends a structure (the last one may be cut by max_tokens)
        assert choice.text.count("<") in (2 * len(opened), 2 * len(opened) - 1), choice.text
        complete = opened if choice.finish_reason == "stop" else opened[:-1]
        assert complete, choice.text
        for part in complete:
            assert part.startswith("w>") and "</f>" in part, choice.text
            jsonschema.validate(json.loads(part[2:part.index("</f>")]), UNIT)
    for path, body, param in (
            ("/v1/completions", {"structural_tag": "{not json"}, "structural_tag"),
            ("/v1/completions", {"structured_outputs": {"structural_tag": '{"triggers": ["<"]}'}},
             "structured_outputs.structural_tag"),
            ("/v1/chat/completions", {"response_format": {"type": "structural_tag", "format": {"type": "bogus"}}},
             "response_format"),
            ("/v1/chat/completions", {"response_format": {"type": "structural_tag", "triggers": ["<"]}},
             "response_format")):
        body = {**body, **({"messages": ASK} if "chat" in path else {"prompt": "x"})}
        response = httpx.post(server.url + path, json=body, timeout=120)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"].startswith(param), response.text
