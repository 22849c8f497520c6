"""Tool calls in the models' own formats: what a chat template renders for an assistant's calls parses back to the
same calls (Hermes-style for Qwen 2.5/3, JSON for Llama 3.x), streamed or whole; the tools reach the template."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from appliance.model_zoo.tokenizer import compile_chat_template
from appliance.server.protocol import ChatCompletionRequest
from appliance.server.tools import CallStream, ToolChoiceValue, detect_parser, forced_calls, parse_calls

TEMPLATES = Path(__file__).resolve().parents[1] / "data" / "templates"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in <b>a city</b>",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}, "days": {"type": "integer"}},
                                               "required": ["city"]}}}]
CALL = {"name": "get_weather", "arguments": {"city": "Zürich", "days": 3}}
FORMATS = {"qwen2_5_tools.jinja": ("hermes", "<|im_start|>assistant", "<|im_end|>"),
           "llama3_1_tools.jinja": ("llama3_json", "assistant<|end_header_id|>\n\n", "<|eot_id|>")}


def _render(name: str, with_call: bool) -> str:
    template = compile_chat_template((TEMPLATES / name).read_text())
    request = ChatCompletionRequest.model_validate({"messages": [
        {"role": "user", "content": "Weather in Zürich?"},
        *([{"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function", "function": {"name": CALL["name"],
                                                             "arguments": json.dumps(CALL["arguments"])}}]}]
          if with_call else [])], "tools": TOOLS})
    messages = [m.for_template() for m in request.messages]
    return template.render(messages=messages, tools=[t.model_dump(exclude_none=True) for t in request.tools],
                           add_generation_prompt=not with_call, bos_token="<s>", eos_token="</s>")


def _assistant_text(name: str) -> str:
    _, start, end = FORMATS[name]
    rendered = _render(name, with_call=True)
    return rendered[rendered.rindex(start) + len(start):].split(end)[0].lstrip("\n")


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_templates_render_the_tools_and_their_calls_parse_back(name):
    parser = FORMATS[name][0]
    assert detect_parser((TEMPLATES / name).read_text()) == parser
    prompt = _render(name, with_call=False)
    assert '"get_weather"' in prompt and "<b>a city</b>" in prompt  # tojson as transformers: no HTML escaping
    text = _assistant_text(name)
    content, calls = parse_calls(text, parser)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [
        (CALL["name"], CALL["arguments"])]
    assert calls[0].id.startswith("call_")


@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize("step", [1, 3, 7])
def test_streamed_calls_equal_whole_ones(name, step):
    parser = FORMATS[name][0]
    lead = "Let me check. " if parser == "hermes" else ""
    text = lead + _assistant_text(name)
    stream = CallStream(parser)
    shown = "".join(stream.feed(text[i:i + step]) for i in range(0, len(text), step))
    rest, calls = stream.finish()
    assert (shown + rest).strip() == lead.strip()
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [(CALL["name"], CALL["arguments"])]


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "none"])
def test_plain_text_stays_content(parser):
    text = "It is sunny in <b>Zürich</b>; {not a call}"
    stream = CallStream(parser)
    shown = "".join(stream.feed(text[i:i + 4]) for i in range(0, len(text), 4))
    rest, calls = stream.finish()
    assert shown + rest == text and calls == []
    assert parse_calls(text, parser) == (text, [])


def test_forced_calls_and_choice_grammar():
    required = ToolChoiceValue("required")
    calls = forced_calls('[{"name": "get_weather", "parameters": {"city": "Oslo"}}]', required)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"})]
    assert forced_calls('[{"name": "get_we', required) == []  # cut short: no call
    named = ToolChoiceValue("named", "get_weather")
    assert [(c.name, c.arguments) for c in forced_calls('{"city": "Oslo"}', named)] == [
        ("get_weather", '{"city": "Oslo"}')]
    request = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "tools": TOOLS,
                                                    "tool_choice": "required"})
    schema = json.loads(request.grammar().schema)
    assert schema["items"]["anyOf"][0]["properties"]["name"] == {"const": "get_weather"}
