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


def _joined(news) -> list[tuple[str, str, str]]:
    """(id, name, arguments) per call from CallStream.call_deltas' news: announced once, then arguments appended."""
    calls = []
    for k, call_id, name, args in news:
        if k == len(calls):
            assert call_id and name
            calls.append((call_id, name, args))
        else:
            assert call_id is None and name is None and k < len(calls)
            calls[k] = (calls[k][0], calls[k][1], calls[k][2] + args)
    return calls


@pytest.mark.parametrize("parser", ["hermes", "llama3_json"])
@pytest.mark.parametrize("step", [1, 3, 7])
def test_auto_calls_stream_their_name_once_then_their_arguments(parser, step):
    """vLLM's tool parsers stream a call as it is written: its id and name once, then its arguments in pieces; two
    calls (Hermes blocks, or Llama JSON objects after the python tag, joined by ';') stream apart, and what a client
    joins is the calls of the whole output. The arguments arrive before the output ends."""
    other = {"name": "get_time", "arguments": {"zone": "CET"}}
    if parser == "hermes":
        text = "Checking. " + "".join(f"<tool_call>\n{json.dumps(c)}\n</tool_call>\n" for c in (CALL, other))
    else:
        text = "<|python_tag|>" + "; ".join(json.dumps({"name": c["name"], "parameters": c["arguments"]})
                                            for c in (CALL, other))
    stream = CallStream(parser)
    news, shown, before_end = [], "", 0
    for i in range(0, len(text), step):
        shown += stream.feed(text[i:i + step])
        got = stream.call_deltas()
        news += got
        before_end += sum(len(args) for *_, args in got)
    rest, calls = stream.finish()
    joined = _joined(news)
    assert [(name, json.loads(args)) for _, name, args in joined] == [(c.name, json.loads(c.arguments))
                                                                      for c in calls]
    assert [name for _, name, _ in joined] == ["get_weather", "get_time"] and stream.announced == 2
    assert (shown + rest).strip() == ("Checking." if parser == "hermes" else "")
    assert len({call_id for call_id, _, _ in joined}) == 2
    assert sum(1 for k, call_id, *_ in news if call_id) == 2 and len(news) > 2 + (step == 7)  # in pieces


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "none"])
def test_plain_text_stays_content(parser):
    text = "It is sunny in <b>Zürich</b>; {not a call}"
    stream = CallStream(parser)
    shown = "".join(stream.feed(text[i:i + 4]) for i in range(0, len(text), 4))
    rest, calls = stream.finish()
    assert shown + rest == text and calls == [] and stream.call_deltas() == [] and stream.announced == 0
    assert parse_calls(text, parser) == (text, [])
    tagged = CallStream(parser)  # text that begins like Llama's python tag is held only while it may be the tag
    assert "".join(tagged.feed(c) for c in "<|p<b>") == "<|p<b>" and tagged.finish() == ("", [])


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


def test_a_call_left_malformed_comes_again_as_content():
    """A Hermes call cut short (max_tokens) streamed its name and the arguments written; the whole output does not
    parse as a call, so it is content at the end: nothing the model wrote is lost."""
    text = 'Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Os'
    stream = CallStream("hermes")
    shown = "".join(stream.feed(text[i:i + 5]) for i in range(0, len(text), 5))
    joined = _joined(stream.call_deltas())
    rest, calls = stream.finish()
    assert [(name, args) for _, name, args in joined] == [("get_weather", '{"city": "Os')] and calls == []
    assert shown + rest == text


def test_arguments_written_as_a_json_string_stream_whole_once_closed():
    """A model may write a call's arguments as a JSON string (parse_calls takes it as the arguments' text): the
    stream gives that text once the string closes, never the quoted, escaped form."""
    text = '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}\n</tool_call>'
    stream = CallStream("hermes")
    news = []
    for i in range(0, len(text), 3):
        stream.feed(text[i:i + 3])
        news += stream.call_deltas()
    _, calls = stream.finish()
    assert [(name, args) for _, name, args in _joined(news)] == [("get_weather", '{"city": "Oslo"}')]
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Oslo"}')]


PYTHONIC = '[get_weather(city="Zürich", days=3), get_time(zone="CET", exact=True, at=None, hours=[1, 2.5])]'


@pytest.mark.parametrize("text", [PYTHONIC, f"<|python_start|>{PYTHONIC}<|python_end|>", f"\n {PYTHONIC}\n"])
@pytest.mark.parametrize("step", [1, 4, 1000])
def test_pythonic_calls_parse_whole_and_streamed(text, step):
    """vLLM's pythonic parser: a Python list of calls with keyword arguments of literal values (Llama 4's markers
    around it optional); streamed, nothing shows as content and the calls come whole at the end."""
    expected = [("get_weather", {"city": "Zürich", "days": 3}),
                ("get_time", {"zone": "CET", "exact": True, "at": None, "hours": [1, 2.5]})]
    content, calls = parse_calls(text, "pythonic")
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == expected
    assert len({c.id for c in calls}) == 2
    stream = CallStream("pythonic")
    shown = "".join(stream.feed(text[i:i + step]) for i in range(0, len(text), step))
    assert stream.call_deltas() == [] and stream.announced == 0  # (the formatter sends them whole at the end)
    rest, streamed = stream.finish()
    assert shown + rest == "" and [(c.name, json.loads(c.arguments)) for c in streamed] == expected


@pytest.mark.parametrize("text", [
    "It is sunny in [Zürich](https://example.com).", "[1, 2, 3]", "[]", '[get_weather("Zürich")]',
    "[get_weather(city=open('x'))]", "[get_weather(**kw)]", "[os.system(cmd='ls')]", "[get_weather(city=",
    "<|python_start|> not a list"])
def test_pythonic_text_that_is_not_a_list_of_calls_stays_content(text):
    assert parse_calls(text, "pythonic") == (text, [])
    stream = CallStream("pythonic")
    shown = "".join(stream.feed(c) for c in text)
    rest, calls = stream.finish()
    assert shown + rest == text and calls == []


def test_the_pythonic_parser_is_a_serve_flag():
    from appliance.config import Config
    from appliance.errors import ConfigError

    assert Config.flat(tool_call_parser="pythonic").server.tool_call_parser == "pythonic"
    with pytest.raises(ConfigError, match="pythonic"):
        Config.flat(tool_call_parser="pythonic_v2")


@pytest.mark.parametrize("stream", [True, False])
def test_pythonic_calls_through_the_chat_format(stream):
    """With tool_choice auto and the pythonic parser, a choice's calls come as the message's tool_calls (streamed:
    whole, in the last chunk) and the choice ends with finish_reason tool_calls; no content."""
    from appliance.engine.request import RequestOutput
    from appliance.server.formatting import ChatFormat, Choice, usage_of

    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "weather?"}], "tools": TOOLS})
    fmt, choice = ChatFormat("id", "m", None, body, "pythonic"), Choice(0)
    pieces = [PYTHONIC[i:i + 6] for i in range(0, len(PYTHONIC), 6)]
    content, calls, reason = "", [], None
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        out = RequestOutput("r", [1], piece, last, "stop" if last else None, 3, 0, i + 1)
        choice.add(out)
        for chunk in fmt.chunk(choice, out, None) if stream else []:
            delta = chunk.choices[0].delta
            content += delta.content or ""
            calls += [(c.function.name, json.loads(c.function.arguments)) for c in delta.tool_calls or []]
            reason = chunk.choices[0].finish_reason or reason
    if not stream:
        message = fmt.final([choice], usage_of([choice])).choices[0]
        content, reason = message.message.content or "", message.finish_reason
        calls = [(c.function.name, json.loads(c.function.arguments)) for c in message.message.tool_calls]
    assert content == "" and reason == "tool_calls"
    assert calls == [("get_weather", {"city": "Zürich", "days": 3}),
                     ("get_time", {"zone": "CET", "exact": True, "at": None, "hours": [1, 2.5]})]


def test_a_pythonic_template_is_detected():
    llama32 = "...respond in the format [func_name1(params_name1=params_value1, params_name2=params_value2...)]..."
    assert detect_parser(llama32) == "pythonic" and detect_parser("{{ '<|python_start|>' }}") == "pythonic"
    assert detect_parser(llama32, "hermes") == "hermes"
