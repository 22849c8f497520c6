"""The reasoning split (`--reasoning-parser`): whole outputs and streams cut anywhere agree; where the output starts
(the template's open think block, deepseek_r1's thinking first, an opening tag) decides what comes first."""
from __future__ import annotations

import random

import pytest

from appliance.server.reasoning import ReasoningStream, opens_thinking, split, waits_for_thinking


@pytest.mark.parametrize("text, thinking, expected", [
    ("<think>\nweigh it</think>\n\nYes.", False, ("\nweigh it", "\n\nYes.")),
    ("\n<think>a</think>b", False, ("a", "b")),  # leading whitespace before the opening tag
    ("weigh it</think>Yes.", True, ("weigh it", "Yes.")),  # the template opened the block
    ("weigh it</think>Yes.", False, ("", "weigh it</think>Yes.")),  # no block open: all content
    ("still thinking", True, ("still thinking", "")),  # cut before </think>
    ("<think>still", False, ("still", "")),
    ("Yes.", False, ("", "Yes.")),
    ("<thin", False, ("", "<thin")),  # an opening tag that never completed is text
    ("a</thi", True, ("a</thi", "")),
    ("a</think>b</think>c", True, ("a", "b</think>c")),  # only the first closing tag ends thinking
    ("", True, ("", "")),
])
def test_whole_outputs_split_at_the_first_closing_tag(text, thinking, expected):
    assert split(text, thinking) == expected


@pytest.mark.parametrize("seed", range(20))
def test_streams_cut_anywhere_give_the_whole_output_split(seed):
    rng = random.Random(seed)
    text = rng.choice(["", "<think>", " \n<think>"]) + "".join(
        rng.choice(["a", " ", "<", "/", "think", ">", "</think>", "<think>", "\n"]) for _ in range(rng.randint(0, 30)))
    thinking = rng.random() < 0.5
    stream = ReasoningStream(thinking)
    reasoning = content = ""
    at = 0
    while at < len(text):
        step = rng.randint(1, 4)
        r, c = stream.feed(text[at:at + step])
        reasoning, content, at = reasoning + r, content + c, at + step
    r, c = stream.finish()
    assert (reasoning + r, content + c) == split(text, thinking), text


def test_held_back_is_only_what_may_be_a_tag():
    stream = ReasoningStream(thinking=True)
    assert stream.feed("plan </th") == ("plan ", "")
    assert stream.feed("ink>ok") == ("", "ok")
    stream = ReasoningStream(thinking=False)
    assert stream.feed("<th") == ("", "")
    assert stream.feed("at") == ("", "<that")


def test_where_the_output_starts():
    qwen_on = "<|im_start|>assistant\n"
    qwen_off = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    qwen_thinking_template = "<|im_start|>assistant\n<think>\n"
    assert not opens_thinking(qwen_on, "qwen3")  # the model writes <think> itself
    assert not opens_thinking(qwen_off, "qwen3")
    assert opens_thinking(qwen_thinking_template, "qwen3")
    assert opens_thinking(qwen_off, "deepseek_r1")
    assert not opens_thinking(qwen_thinking_template, "none")


def test_a_grammar_waits_for_thinking_unless_the_prompt_closed_it_or_a_call_is_forced():
    from appliance.server.protocol import ChatCompletionRequest

    ask = {"messages": [{"role": "user", "content": "JSON?"}], "response_format": {"type": "json_object"}}
    plain = ChatCompletionRequest.model_validate(ask)
    forced = ChatCompletionRequest.model_validate({**ask, "response_format": None, "tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]})
    assert waits_for_thinking("<|im_start|>assistant\n", plain)  # Qwen3 thinks unless told not to
    assert waits_for_thinking("<|im_start|>assistant\n<think>\n", plain)
    assert not waits_for_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n", plain)  # enable_thinking off
    assert not waits_for_thinking("<|im_start|>assistant\n", forced)


def test_tool_calls_after_the_reasoning_are_parsed_from_the_content():
    """Qwen3 thinks, then calls a tool: the call is read from what follows </think>, streamed (its name once, then
    its arguments as they come) and whole alike."""
    from appliance.engine.request import RequestOutput
    from appliance.server.formatting import ChatFormat, Choice, usage_of
    from appliance.server.protocol import ChatCompletionRequest

    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "weather?"}], "tools": [
        {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]})
    text = '<think>\nI should call it.</think>\n\n<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}' \
           '\n</tool_call>'
    pieces = [text[i:i + 5] for i in range(0, len(text), 5)]
    fmt, choice = ChatFormat("id", "m", None, body, "hermes", thinking=False), Choice(0)
    streamed = {"reasoning": "", "content": "", "calls": []}  # calls: (name, arguments), deltas joined per index
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        out = RequestOutput("r", [1], piece, last, "stop" if last else None, 3, 0, i + 1)
        choice.add(out)
        for chunk in fmt.chunk(choice, out, None):
            delta = chunk.choices[0].delta
            streamed["reasoning"] += delta.reasoning or ""
            streamed["content"] += delta.content or ""
            for c in delta.tool_calls or []:
                if c.index == len(streamed["calls"]):  # announced: id, type and name come once, first
                    assert c.id and c.type == "function" and c.function.name
                    streamed["calls"].append((c.function.name, ""))
                name, arguments = streamed["calls"][c.index]
                streamed["calls"][c.index] = (name, arguments + (c.function.arguments or ""))
            reason = chunk.choices[0].finish_reason
    assert streamed == {"reasoning": "\nI should call it.", "content": "\n\n",
                        "calls": [("weather", '{"city": "Oslo"}')]} and reason == "tool_calls"
    message = fmt.final([choice], usage_of([choice])).choices[0]
    assert message.message.reasoning == "\nI should call it." and message.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in message.message.tool_calls] == [
        ("weather", '{"city": "Oslo"}')]
    assert message.message.content is None
