"""Structured outputs and tool calling over HTTP, through the official ``openai`` client against
``mode=serve`` on tiny random-weight models: ``response_format`` (``chat.completions.parse`` with a
pydantic model), vLLM's ``structured_outputs``, tools with ``tool_choice`` required / named (valid
calls every time, streamed deltas that assemble to the whole call, an agent round trip), a
thinking model's ``reasoning_content``, and bad input as 400s naming the problem."""

from __future__ import annotations

import json
import re
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from serving import serving_tiny

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "pattern": "^[A-Za-z ]{1,10}$"}, "unit": {"enum": ["C", "F"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 12}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}


class Shape(BaseModel):
    kind: Literal["circle", "square", "triangle"]
    sides: int = Field(ge=0, le=8)
    label: str = Field(max_length=6)


# Each family's tool syntax: Qwen3's Hermes JSON (its template renders tools), Qwen3.5's XML (likewise),
# Gemma 3's and Llama 3.0's (templates without tools: the Hermes / Llama wording in the system message;
# slow cases for suite time: test_tools renders every family's format through its template). The
# Qwen3 server runs a held-out copy with no quant= given: the int8wo weights users get by default.
@pytest.fixture(
    scope="module",
    params=[
        "qwen3",
        pytest.param("qwen3.5", marks=pytest.mark.slow),
        pytest.param("gemma3", marks=pytest.mark.slow),
        pytest.param("llama", marks=pytest.mark.slow),
    ],
)
def server(request, tmp_path_factory, tiny_dir, held_out_dir):
    family = request.param
    path = held_out_dir(family) if family == "qwen3" else tiny_dir(family)
    with serving_tiny(tmp_path_factory.mktemp("serve"), path, family) as running:
        running.family = family
        yield running


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def test_parse_returns_the_pydantic_object(server):
    got = client(server).chat.completions.parse(
        model=server.family, response_format=Shape, max_tokens=64, messages=[{"role": "user", "content": "A shape?"}]
    )
    shape = got.choices[0].message.parsed
    assert isinstance(shape, Shape)
    assert got.choices[0].finish_reason == "stop"


def test_json_object_regex_choice_grammar(server):
    c = client(server)
    ask = dict(model=server.family, messages=[{"role": "user", "content": "Answer"}], max_tokens=40)
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["n"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema, "strict": True}}
    jsonschema.validate(
        json.loads(c.chat.completions.create(**ask, response_format=fmt).choices[0].message.content), schema
    )
    small = {"type": "json_object"}
    done = c.chat.completions.create(**ask, response_format=small, extra_body={"max_tokens": 2})
    assert done.choices[0].finish_reason == "length"  # cut: reported, never presented as complete JSON
    text = c.chat.completions.create(**ask, extra_body={"structured_outputs": {"regex": r"[A-Z]{2}-\d{2}"}})
    assert re.fullmatch(r"[A-Z]{2}-\d{2}", text.choices[0].message.content)
    pick = c.chat.completions.create(**ask, extra_body={"structured_outputs": {"choice": ["up", "down"]}})
    assert pick.choices[0].message.content in ("up", "down")
    ebnf = c.completions.create(
        model=server.family,
        prompt="Say",
        max_tokens=10,
        extra_body={"structured_outputs": {"grammar": 'root ::= "ha" ("ha")? "!"'}},
    )
    assert ebnf.choices[0].text in ("ha!", "haha!")


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_required_and_named_tool_calls_are_valid_every_time(server, choice):
    c = client(server)
    for i in range(10):
        got = c.chat.completions.create(
            model=server.family,
            tools=[WEATHER, CLOCK],
            tool_choice=choice,
            max_tokens=200,
            messages=[{"role": "user", "content": f"Question {i}"}],
            temperature=1.0,
            seed=i,
            parallel_tool_calls=False,
        )
        out = got.choices[0]
        assert out.finish_reason == "tool_calls"
        for call in out.message.tool_calls:
            if isinstance(choice, dict):
                assert call.function.name == "get_time"
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
            assert call.id and call.type == "function"


def test_streamed_tool_call_deltas_assemble_to_the_whole_call(server):
    c = client(server)
    ask = dict(
        model=server.family,
        tools=[WEATHER, CLOCK],
        tool_choice="required",
        max_tokens=200,
        seed=3,
        messages=[{"role": "user", "content": "Weather?"}],
        parallel_tool_calls=False,
    )
    whole = c.chat.completions.create(**ask).choices[0]
    calls: dict[int, dict] = {}
    finish = None
    for chunk in c.chat.completions.create(**ask, stream=True):
        for part in chunk.choices:
            finish = part.finish_reason or finish
            for d in part.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": d.id, "name": d.function.name, "arguments": ""})
                if d.id:
                    assert call["arguments"] == ""  # id and name come first
                call["arguments"] += d.function.arguments or ""
    assert finish == "tool_calls"
    assert [(x["name"], x["arguments"]) for x in calls.values()] == [
        (t.function.name, t.function.arguments) for t in whole.message.tool_calls
    ]


def test_agent_round_trip_through_the_client(server):
    c = client(server)
    messages = [{"role": "user", "content": "What's the weather in Oslo?"}]
    asked = c.chat.completions.create(
        model=server.family, tools=[WEATHER], tool_choice="required", max_tokens=200, messages=messages
    )
    first = asked.choices[0].message
    call = first.tool_calls[0]
    result = json.dumps({"temperature_celsius": 3, "sky": "clear"})
    messages += [first.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id, "content": result}]
    second = c.chat.completions.create(model=server.family, tools=[WEATHER], max_tokens=8, messages=messages)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # the call and its result are in the rendered prompt (the template's own rendering, or the fallback's)
    assert second.usage.prompt_tokens > asked.usage.prompt_tokens + asked.usage.completion_tokens


@pytest.mark.parametrize(
    "body, message",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objec"}}}},
            'Unsupported type "objec"',
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "integer", "multipleOf": 2}},
                }
            },
            "'multipleOf' is not supported",
        ),
        ({"structured_outputs": {"regex": "a(b"}}, "regex: Regex parsing error"),
        ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools[0].function.name is missing"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "'nope', which is not in tools",
        ),
        ({"tool_choice": "required"}, "tool_choice needs tools"),
        ({"response_format": {"type": "xml"}}, "response_format.type must be"),
    ],
)
def test_bad_structured_requests_are_400_naming_the_problem(server, body, message):
    c = client(server)
    with pytest.raises(openai.BadRequestError) as err:
        c.chat.completions.create(
            model=server.family, messages=[{"role": "user", "content": "x"}], max_tokens=4, extra_body=body
        )
    assert message in err.value.body["message"]
    assert c.chat.completions.create(
        model=server.family, messages=[{"role": "user", "content": "x"}], max_tokens=2
    ).choices[0].finish_reason in ("length", "stop")
