"""Reading tool calls back out of a model's text, in each family's syntax (Qwen's Hermes JSON,
Qwen3.5's XML, Llama 3's bare JSON), whole and as a stream: the deltas a client assembles equal
the whole answer, whatever the pieces; and writing tools into a conversation for a template that
cannot render them (Gemma 3), which must still render."""

from __future__ import annotations

import json

import pytest

from pipeline import UserError
from pipeline.serve.answer import Deltas, Reading, message
from pipeline.testing import make_tokenizer
from pipeline.structured.tools import HERMES, LLAMA, XML, fallback_messages, parse, tool_format
from stages.tokenize import render

PARAMS = {
    "get_weather": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "hourly": {"type": "boolean"}},
    },
    "get_time": {"type": "object", "properties": {"zone": {"type": "integer"}}},
}
TOOLS = [{"type": "function", "function": {"name": name, "parameters": params}} for name, params in PARAMS.items()]
ANSWERS = {
    HERMES: (
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
        '\n<tool_call>\n{"name": "get_time", "arguments": {"zone": -5}}\n</tool_call>'
    ),
    XML: (
        "Let me look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n"
        "<parameter=zone>\n-5\n</parameter>\n</function>\n</tool_call>"
    ),
    LLAMA: '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}; '
    '{"name": "get_time", "parameters": {"zone": -5}}',
}
EXPECTED = [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"zone": -5})]


@pytest.mark.parametrize(
    "family, fmt",
    [
        ("qwen3", HERMES),
        ("qwen3-vl", HERMES),
        ("qwen3.5", XML),
        ("qwen3.5-text", XML),
        ("llama", LLAMA),
        ("gemma3", HERMES),
    ],
)
def test_each_family_calls_tools_in_its_published_syntax(family, fmt):
    tok = make_tokenizer(family)
    assert tool_format(tok.chat_template, tok.get_vocab()) == fmt


@pytest.mark.parametrize("fmt", [HERMES, XML, LLAMA])
def test_whole_answers_give_the_calls_with_json_arguments(fmt):
    parsed = parse(ANSWERS[fmt], fmt, params=PARAMS)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == EXPECTED
    assert all(c.complete for c in parsed.calls)
    assert parsed.content == ("" if fmt == LLAMA else "Let me look.")
    out, finish = message(Reading(fmt, PARAMS), ANSWERS[fmt], False, "stop")
    assert finish == "tool_calls" and len(out["tool_calls"]) == 2


def test_xml_values_take_the_type_their_schema_gives():
    text = (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n<parameter=hourly>\ntrue\n"
        "</parameter>\n<parameter=note>\nline one\nline two\n</parameter>\n<parameter=unit>\rC\t</parameter>\n"
        "</function>\n</tool_call>"
    )
    params = {
        "get_weather": {
            **PARAMS["get_weather"],
            "properties": {**PARAMS["get_weather"]["properties"], "unit": {"enum": ["C", "F"]}},
        }
    }
    (call,) = parse(text, XML, params=params).calls
    assert json.loads(call.arguments) == {"city": "42", "hourly": True, "note": "line one\nline two", "unit": "C"}


@pytest.mark.parametrize("fmt", [HERMES, XML, LLAMA])
@pytest.mark.parametrize("size", [1, 3, 7])
def test_streamed_deltas_assemble_to_the_whole_answer(fmt, size):
    text, reading = "<think>\nweather first\n</think>\n\n" + ANSWERS[fmt], Reading(fmt, PARAMS, thinks=True)
    whole, _ = message(reading, text, False, "stop")
    stream = Deltas(reading, opened=False)
    got: dict = {"reasoning_content": "", "content": "", "calls": {}}
    for piece in (text[i : i + size] for i in range(0, len(text), size)):
        delta = stream.add(piece)
        for key in ("reasoning_content", "content"):
            got[key] += delta.get(key, "")
        for d in delta.get("tool_calls", []):
            if "id" in d:  # a new call: id and name first, no arguments yet
                assert d["index"] not in got["calls"] and d["function"]["arguments"] == ""
                got["calls"][d["index"]] = {"id": d["id"], "name": d["function"]["name"], "arguments": ""}
            got["calls"][d["index"]]["arguments"] += d["function"]["arguments"]
    assert stream.flush() == {}
    assert got["reasoning_content"] == whole["reasoning_content"] == "weather first"
    assert got["content"] == (whole["content"] or "")
    assert [(c["name"], c["arguments"]) for c in got["calls"].values()] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in whole["tool_calls"]
    ]


@pytest.mark.parametrize(
    "fmt, text, held",
    [(HERMES, "a < b and <tool", " <tool"), (XML, "x \n\n", " \n\n"), (LLAMA, '{"na', '{"na'), (None, "<thi", "<thi")],
)
def test_text_that_only_looks_like_a_tag_starting_is_sent_at_the_end(fmt, text, held):
    reading = Reading(fmt, PARAMS, thinks=True)
    stream = Deltas(reading, opened=False)
    assert stream.add(text).get("content", "") == text.removesuffix(held)  # it may begin a call or a tag
    assert stream.flush() == {"content": held}
    assert message(reading, text, False, "length")[0]["content"] == text  # the whole answer keeps it all


def test_gemma3_renders_tools_calls_and_results_through_the_fallback():
    tok = make_tokenizer("gemma3")
    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": 2}'}}
    conversation = [
        {"role": "user", "content": "What time is it in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"time": "10:42"}'},
        {"role": "user", "content": "And in summer?"},
    ]
    text = render(tok, fallback_messages(conversation, TOOLS, tool_format(tok.chat_template, tok.get_vocab())), {})
    assert '"name": "get_time"' in text and "<tool_call>" in text  # the tools, described, and the call
    assert '<tool_response>\n{"time": "10:42"}\n</tool_response>\n\nAnd in summer?' in text
    assert text.count("<start_of_turn>user") == 2  # the results and the next question: one turn


def test_a_conversation_the_template_refuses_is_a_user_error():
    tok = make_tokenizer("gemma3")
    with pytest.raises(UserError, match="chat template refused.*alternate"):
        render(tok, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], {})
