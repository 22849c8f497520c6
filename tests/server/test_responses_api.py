"""OpenAI's Responses API (/v1/responses) against a real `muxd serve`: its bodies and every streamed event validate as
the openai package's own types, its text is what the same chat request writes, reasoning comes as a reasoning item,
function tools as function_call items, and what it does not serve (stored responses, hosted tools) is a 400 naming
the field."""
from __future__ import annotations

import json

import httpx
import pytest
from pydantic import TypeAdapter

openai_types = pytest.importorskip("openai.types.responses")
EVENTS = TypeAdapter(openai_types.ResponseStreamEvent)

OPENS_THINKING = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
                  "<|assistant|>\n<think>\n")


@pytest.fixture(scope="module")
def server(shared_serve):
    return shared_serve("--kv-cache-memory", "64MiB", "--max-model-len", "512")


def respond(server, **body) -> httpx.Response:
    return httpx.post(server.url + "/v1/responses", json=body, timeout=60)


def events_of(response: httpx.Response) -> list:
    lines = response.text.splitlines()
    named = [line[7:] for line in lines if line.startswith("event: ")]
    events = [EVENTS.validate_python(json.loads(line[6:])) for line in lines if line.startswith("data: {")]
    assert named == [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events


def message_text(response) -> str:
    return "".join(part.text for item in response.output if item.type == "message" for part in item.content)


def test_a_response_is_the_chat_answer_as_openai_types(server, model_name, client):
    chat = client.chat.completions.create(model=model_name, max_tokens=6, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"}])
    body = {"model": model_name, "input": "Say hi", "instructions": "Be brief.", "max_output_tokens": 6,
            "temperature": 0, "store": False, "metadata": {"k": "v"}, "include": ["reasoning.encrypted_content"]}
    whole = respond(server, **body)
    assert whole.status_code == 200, whole.text
    response = openai_types.Response.model_validate(whole.json())
    assert message_text(response) == chat.choices[0].message.content
    length = chat.choices[0].finish_reason == "length"
    assert response.status == ("incomplete" if length else "completed")
    assert (response.incomplete_details.reason if length else response.incomplete_details) == (
        "max_output_tokens" if length else None)
    assert (response.usage.input_tokens, response.usage.output_tokens) == (
        chat.usage.prompt_tokens, chat.usage.completion_tokens)

    events = events_of(respond(server, **body, stream=True))
    assert [e.type for e in events[:4]] == ["response.created", "response.in_progress", "response.output_item.added",
                                            "response.content_part.added"]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == message_text(response)
    assert [e.text for e in events if e.type == "response.output_text.done"] == [deltas]
    assert events[-1].type == f"response.{response.status}" and message_text(events[-1].response) == deltas

    sdk = client.responses.create(model=model_name, input=[{"role": "user", "content": "Say hi"}],
                                  instructions="Be brief.", max_output_tokens=6, temperature=0)
    assert sdk.output_text == deltas
    streamed = list(client.responses.create(model=model_name, input="Say hi", instructions="Be brief.",
                                            max_output_tokens=6, temperature=0, stream=True))
    assert streamed[-1].response.output_text == deltas


def test_conversations_and_formats_as_chat_takes_them(server, model_name):
    first = respond(server, model=model_name, input="Hi", max_output_tokens=4, temperature=0).json()
    follow = [{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}, *first["output"],
              {"type": "message", "role": "user", "content": "And?"}]
    assert respond(server, model=model_name, input=follow, max_output_tokens=4).status_code == 200
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    constrained = respond(server, model=model_name, input="JSON please", max_output_tokens=40, temperature=0,
                          text={"format": {"type": "json_schema", "name": "a", "schema": schema, "strict": True}})
    assert constrained.status_code == 200, constrained.text
    text = message_text(openai_types.Response.model_validate(constrained.json()))
    if constrained.json()["status"] == "completed":
        assert isinstance(json.loads(text)["a"], int)


WEATHER = {"type": "function", "name": "weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def test_function_tools_call_and_take_their_outputs_back(server, model_name, client):
    """A forced call comes as a function_call item (whole and streamed); the call and its output sent back as input
    items make the conversation the chat request with the assistant's tool call and the tool's message makes."""
    body = {"model": model_name, "input": "Weather in Oslo?", "tools": [WEATHER], "max_output_tokens": 60,
            "temperature": 0, "tool_choice": {"type": "function", "name": "weather"}}
    whole = openai_types.Response.model_validate(respond(server, **body).json())
    calls = [item for item in whole.output if item.type == "function_call"]
    assert [c.name for c in calls] == ["weather"] and calls[0].call_id
    if whole.status == "completed":
        assert isinstance(json.loads(calls[0].arguments)["city"], str)
    events = events_of(respond(server, **body, stream=True))
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert args == calls[0].arguments
    assert [e.arguments for e in events if e.type == "response.function_call_arguments.done"] == [args]
    assert [i.type for i in events[-1].response.output] == [i.type for i in whole.output]

    turn = [{"role": "user", "content": "Weather in Oslo?"},
            {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": '{"city": "Oslo"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "Sunny, 21 C"}]
    answered = respond(server, model=model_name, input=turn, tools=[WEATHER], max_output_tokens=5, temperature=0)
    assert answered.status_code == 200, answered.text
    call = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
    chat = client.chat.completions.create(model=model_name, max_tokens=5, temperature=0, tools=[
        {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}], messages=[
        turn[0], {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"}])
    assert answered.json()["usage"]["input_tokens"] == chat.usage.prompt_tokens
    assert message_text(openai_types.Response.model_validate(answered.json())) == (
        chat.choices[0].message.content or "")


@pytest.mark.parametrize("body, param", [
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools.0"),
    ({"input": []}, "input"),
    ({"input": ["x", {"type": "computer_call_output", "call_id": "c", "output": {}}]}, "input.1"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice"),  # no tools to call
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a"}}}, "text.format"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "max_output_tokens": 100000}, "max_output_tokens"),
    ({"input": "x", "truncation": "auto"}, "truncation"),
    ({"input": "x", "include": ["message.output_text.logprobs"]}, "include.0"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input"),  # nothing to answer
    ({"input": "x", "tools": [{"type": "function", "name": "no spaces"}]}, "tools.0.name"),
    ({"input": "x", "slo_class": "gold"}, "slo_class"),
    ({"input": "x", "temprature": 1}, "temprature"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "background": 0}, "background"),  # not a boolean (a Literal[False] took 0 as False)
])
def test_what_is_not_served_is_a_400_naming_the_field(server, model_name, body, param):
    response = respond(server, model=model_name, **body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.text


def test_reasoning_is_an_item_before_the_message(shared_serve, model_name):
    server = shared_serve("--kv-cache-memory", "64MiB", "--max-model-len", "512", "--chat-template", OPENS_THINKING,
                          "--reasoning-parser", "qwen3")
    body = {"model": model_name, "input": "Is 7 prime?", "max_output_tokens": 8, "temperature": 0}
    response = openai_types.Response.model_validate(respond(server, **body).json())
    kinds = [item.type for item in response.output]
    assert kinds == ["reasoning", "message"] and response.output[0].content[0].text
    events = events_of(respond(server, **body, stream=True))
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert reasoning == response.output[0].content[0].text
    assert [item.type for item in events[-1].response.output] == kinds
    hidden = respond(server, **body, reasoning={"effort": "low"}).json()
    assert [item["type"] for item in hidden["output"]][-1] == "message"


@pytest.mark.parametrize("text", [
    '<think>\nplan</think>\n\n<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
    "<think>a</think>\n\nIt is sunny. \n",
    "<think>cut short",
    "  ",
])
def test_streamed_items_are_the_whole_response_items(text):
    """Whatever the chat output holds (reasoning, blank text before a call, a call parsed from the model's own
    format, text alone), the streamed events end with the items the whole response has."""
    from appliance.engine.request import RequestOutput
    from appliance.server.formatting import Choice, usage_of
    from appliance.server.protocol import ChatCompletionRequest
    from appliance.server.responses_api import ResponsesFormat, ResponsesRequest

    request = ResponsesRequest.model_validate({"input": "weather?", "tools": [WEATHER]})
    chat = request.to_chat(ChatCompletionRequest)

    def run(stream: bool):
        fmt, choice, events = ResponsesFormat("resp-1", "m", chat, request, "hermes", False), Choice(0), []
        pieces = [text[i:i + 3] for i in range(0, len(text), 3)]
        for i, piece in enumerate(pieces):
            last = i == len(pieces) - 1
            out = RequestOutput("r", [1], piece, last, "stop" if last else None, 3, 0, i + 1)
            choice.add(out)
            if stream:
                events += [EVENTS.validate_python(e.model_dump(exclude_none=True))
                           for e in fmt.chunk(choice, out, None)]
        if stream:
            return events
        return openai_types.Response.model_validate(fmt.final([choice], usage_of([choice])).model_dump())

    def items(response) -> list[dict]:  # (a call's id is drawn anew each time)
        return [{**item.model_dump(), "call_id": None} for item in response.output]

    events, whole = run(True), run(False)
    assert items(events[-1].response) == items(whole)
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    assert added == [item.type for item in whole.output]
