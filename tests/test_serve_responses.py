"""``POST /v1/responses`` (OpenAI's Responses API) through the official ``openai`` client against
``mode=serve``: each answer equals the chat completion of the same messages (text, an image,
``instructions``, a follow-up through ``previous_response_id``, tool round trips), streamed events
the client parses into the same answer, structured output, stored responses, refusals as 400/404.
The servers: the embedded default (the tiny Qwen2-VL that names shapes; float64, so batched and
solo answers are identical) and the tiny Qwen3 (its template calls tools)."""

from __future__ import annotations

import base64
import json
import signal
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Literal

import httpx
import openai
import pytest
from openai import omit
from openai._models import construct_type
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import ResponseStreamEvent
from pydantic import BaseModel, Field

from serving import serving
from pipeline.serve.protocol import APIError, ChatCompletionRequest
from pipeline.serve.response_input import input_messages
from pipeline.serve.response_output import Output, whole_delta
from pipeline.serve.responses import Store

ROOT = Path(__file__).resolve().parents[1]
SHAPES = "data:image/png;base64," + base64.b64encode((ROOT / "examples" / "shapes.png").read_bytes()).decode()
QUESTION = "What shapes are in the image?"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "pattern": "^[A-Za-z ]{1,10}$"}, "unit": {"enum": ["C", "F"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
    "strict": True,
}
CHAT_WEATHER = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}


class Shape(BaseModel):
    kind: Literal["circle", "square", "triangle"]
    sides: int = Field(ge=0, le=8)


@pytest.fixture(scope="module")
def servers(tmp_path_factory, tiny_dir):
    """Both servers, started side by side (each mostly waits on its imports)."""
    tmp = tmp_path_factory.mktemp("serve-responses")

    def qwen3() -> str:
        path = tiny_dir("qwen3")
        overrides = (f"model.path={path}", "model.dtype=float32", "kv.memory=64000000", "serve.model_name=qwen3")
        return stack.enter_context(serving(tmp, *overrides))

    with ExitStack() as stack, ThreadPoolExecutor(2) as pool:
        vl = pool.submit(
            lambda: stack.enter_context(
                serving(tmp, "model.dtype=float64", "max_new_tokens=16", "serve.max_tokens=100000")
            )
        )
        q3 = pool.submit(qwen3)
        running = {"vl": vl.result(), "qwen3": q3.result()}
        yield running
        for server in running.values():  # both told first: they shut down side by side
            server.proc.send_signal(signal.SIGTERM)


@pytest.fixture(scope="module")
def vl(servers):
    return openai.OpenAI(base_url=servers["vl"].url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def q3(servers):
    return openai.OpenAI(base_url=servers["qwen3"].url + "/v1", api_key="none", max_retries=0)


def image_input(text: str = QUESTION) -> list[dict]:
    return [
        {
            "role": "user",
            "content": [{"type": "input_image", "image_url": SHAPES}, {"type": "input_text", "text": text}],
        }
    ]


def image_message(text: str = QUESTION) -> dict:
    return {
        "role": "user",
        "content": [{"type": "image_url", "image_url": {"url": SHAPES}}, {"type": "text", "text": text}],
    }


def chat_text(client: openai.OpenAI, messages: list[dict], max_tokens: int, **kw) -> tuple[str, str]:
    got = client.chat.completions.create(
        model=kw.pop("model", "tiny-default"), messages=messages, max_tokens=max_tokens, **kw
    )
    return got.choices[0].message.content, got.choices[0].finish_reason


def answer(response) -> tuple[str | None, list[tuple[str, str]]]:
    """A response as the chat message it is: its text (None when it only calls), its calls."""
    texts = [c.text for item in response.output if item.type == "message" for c in item.content]
    calls = [(item.name, item.arguments) for item in response.output if item.type == "function_call"]
    return ("".join(texts) if texts else None), calls


# --- without a server ------------------------------------------------------------------------


def sdk_state(events: list[str]) -> ResponseStreamState:
    """The events as the openai client's stream reads them (it checks their order and identities)."""
    state = ResponseStreamState(input_tools=omit, text_format=omit)
    for event in events:
        state.handle_event(construct_type(type_=ResponseStreamEvent, value=json.loads(event.split("data: ", 1)[1])))
    return state


def test_streamed_events_build_the_whole_answers_items():
    whole = {
        "reasoning_content": "hmm",
        "content": "Hi there",
        "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}],
    }
    one = Output()
    one.add(whole_delta(whole))
    one.finish("completed")
    pieces = [
        {"reasoning_content": "hm"},
        {"reasoning_content": "m", "content": "Hi"},
        {"content": " there"},
        {"tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"a"'}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]},
    ]
    streamed = Output()
    head = {"id": "resp_1", "object": "response", "created_at": 0, "model": "m", "tools": [], "tool_choice": "auto"}
    head["parallel_tool_calls"] = True
    events = [streamed.event("response.created", response={**head, "status": "in_progress", "output": []})]
    for piece in pieces:
        events += streamed.add(piece)
    events += streamed.finish("incomplete")
    events.append(
        streamed.event("response.incomplete", response={**head, "status": "incomplete", "output": streamed.items})
    )

    def shape(items: list[dict]) -> list[dict]:
        return [{k: v for k, v in item.items() if k not in ("id", "status")} for item in items]

    assert shape(streamed.items) == shape(one.items)
    assert [item["type"] for item in one.items] == ["reasoning", "message", "function_call"]
    assert [item["status"] for item in streamed.items] == ["completed", "completed", "incomplete"]
    kinds = [json.loads(e.split("data: ", 1)[1])["type"] for e in events]
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == 3
    assert "response.function_call_arguments.done" in kinds and "response.reasoning_text.done" in kinds
    numbers = [json.loads(e.split("data: ", 1)[1])["sequence_number"] for e in events]
    assert numbers == list(range(len(events)))
    state = sdk_state(events)
    assert [item.type for item in state._completed_output.values()] == ["reasoning", "message", "function_call"]

    empty = Output()  # neither text nor calls: one empty message, as the chat answer's ""
    empty.add(whole_delta({"content": ""}))
    empty.finish("completed")
    assert [(item["type"], item["content"][0]["text"]) for item in empty.items] == [("message", "")]


def test_store_drops_the_least_recently_used():
    store = Store(2)
    for rid in ("a", "b"):
        store.put({"id": rid}, [])
    assert store.get("a") is not None  # now "b" is the least recently used
    store.put({"id": "c"}, [])
    assert store.get("b") is None and store.get("a") and store.get("c")
    assert store.delete("a") and not store.delete("a")


def test_input_items_as_chat_messages():
    items = [
        {"type": "message", "role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "3 C"},
    ]
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    assert input_messages(items) == [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "3 C"},
    ]
    with pytest.raises(APIError, match=r"input\[0\]: input items of type 'item_reference' are not supported"):
        input_messages([{"type": "item_reference", "id": "x"}])
    with pytest.raises(APIError, match=r"input\[0\].content\[0\]: content parts of type 'input_file'"):
        input_messages([{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}])


# --- the embedded default: text, an image, streaming, follow-ups, the store ---------------------


def test_answers_equal_the_chat_completion(vl):
    image = vl.responses.create(model="tiny-default", input=image_input(), max_output_tokens=16)
    assert image.status == "completed" and image.output_text
    assert (image.output_text, "stop") == chat_text(vl, [image_message()], 16)
    chat = vl.chat.completions.create(model="tiny-default", messages=[image_message()], max_tokens=16)
    assert image.usage.input_tokens == chat.usage.prompt_tokens
    assert image.usage.output_tokens == chat.usage.completion_tokens
    text = vl.responses.create(model="tiny-default", input="Tell me about squares", max_output_tokens=6)
    assert text.output_text == chat_text(vl, [{"role": "user", "content": "Tell me about squares"}], 6)[0]
    told = vl.responses.create(
        model="tiny-default", instructions="Name the shapes.", input=image_input(), max_output_tokens=16
    )
    system = {"role": "system", "content": "Name the shapes."}
    assert told.output_text == chat_text(vl, [system, image_message()], 16)[0]
    assert told.instructions == "Name the shapes." and told.max_output_tokens == 16


def test_max_output_tokens_is_incomplete_whole_or_streamed(vl):
    cut = vl.responses.create(model="tiny-default", input=image_input(), max_output_tokens=2)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage.output_tokens == 2 and cut.output[0].status == "incomplete"
    assert cut.output_text == chat_text(vl, [image_message()], 2)[0]
    events = list(vl.responses.create(model="tiny-default", input=image_input(), max_output_tokens=2, stream=True))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert events[-1].response.output_text == cut.output_text


def test_streamed_events_parse_and_equal_the_whole_answer(vl):
    whole = vl.responses.create(model="tiny-default", input=image_input(), max_output_tokens=16)
    with vl.responses.stream(model="tiny-default", input=image_input(), max_output_tokens=16) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert deltas and "".join(e.delta for e in deltas) == whole.output_text == final.output_text
    item = events[2].item
    assert all(e.item_id == item.id and e.output_index == 0 and e.content_index == 0 for e in deltas)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert vl.responses.retrieve(final.id).output_text == whole.output_text  # stored when streamed too


def test_a_follow_up_is_the_whole_conversation_and_reuses_its_kv(vl):
    first_input = image_input("What shapes are in the image? Please answer with the colours too.")
    first = vl.responses.create(model="tiny-default", input=first_input, max_output_tokens=16)
    follow = dict(model="tiny-default", input="How many shapes are there?", max_output_tokens=8)
    with ThreadPoolExecutor(3) as pool:  # concurrent follow-ups of one response are independent
        second, *others = list(
            pool.map(lambda _: vl.responses.create(previous_response_id=first.id, **follow), range(3))
        )
    assert all(o.output_text == second.output_text for o in others)
    assert second.previous_response_id == first.id
    cached = second.usage.input_tokens_details.cached_tokens
    assert cached >= first.usage.input_tokens // 16 * 16 > 0, cached  # the first turn's prompt, every full block
    conversation = [
        image_message("What shapes are in the image? Please answer with the colours too."),
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "How many shapes are there?"},
    ]
    assert second.output_text == chat_text(vl, conversation, 8)[0]
    third = vl.responses.create(
        model="tiny-default", input="Thanks!", previous_response_id=second.id, max_output_tokens=4
    )
    conversation += [{"role": "assistant", "content": second.output_text}, {"role": "user", "content": "Thanks!"}]
    assert third.output_text == chat_text(vl, conversation, 4)[0]


def test_stored_responses_get_delete_and_unknown_ids(vl, servers):
    kept = vl.responses.create(model="tiny-default", input="Hello", max_output_tokens=2, metadata={"k": "v"})
    assert vl.responses.retrieve(kept.id).model_dump() == kept.model_dump()
    assert kept.metadata == {"k": "v"} and kept.store is True
    vl.responses.delete(kept.id)
    for ask in (
        lambda: vl.responses.retrieve(kept.id),
        lambda: vl.responses.create(model="tiny-default", input="x", previous_response_id=kept.id),
    ):
        with pytest.raises(openai.NotFoundError) as err:
            ask()
        assert kept.id in err.value.body["message"]
    with pytest.raises(openai.NotFoundError) as err:
        vl.responses.create(model="tiny-default", input="x", previous_response_id="resp_nope")
    assert err.value.body["code"] == "previous_response_not_found" and "resp_nope" in err.value.body["message"]
    unstored = vl.responses.create(model="tiny-default", input="Hello", max_output_tokens=2, store=False)
    assert unstored.store is False
    assert httpx.get(f"{servers['vl'].url}/v1/responses/{unstored.id}").status_code == 404


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"include": ["reasoning.encrypted_content"]}, "include: not supported"),
        ({"background": True}, "background: not supported"),
        ({"tools": [{"type": "web_search"}]}, "tools[0]: tools of type 'web_search' are not supported"),
        ({"text": {"format": {"type": "xml"}}}, "text.format.type must be"),
        ({"truncation": "auto"}, "truncation"),
        ({"input": []}, "input is empty"),
        ({"temperature": 3}, "temperature"),
        ({"max_output_tokens": 40000, "stream": True}, "exceed the model's context"),  # the JSON error, no events
    ],
)
def test_unsupported_or_bad_fields_are_400_naming_them(vl, fields, message):
    body = {"input": "x", "max_output_tokens": 2, **fields}
    with pytest.raises(openai.BadRequestError) as err:
        vl.responses.create(model="tiny-default", extra_body=body)
    assert message in err.value.body["message"]


def test_reasoning_effort_goes_to_the_chat_path(q3, vl):
    ask = dict(input="Hello", max_output_tokens=4, reasoning={"effort": "none"})
    if "reasoning_effort" not in ChatCompletionRequest.model_fields:  # a chat path without it: refused
        with pytest.raises(openai.BadRequestError) as err:
            q3.responses.create(model="qwen3", **ask)
        assert "reasoning.effort: not supported" in err.value.body["message"]
        return
    got = q3.responses.create(model="qwen3", **ask)
    assert got.reasoning.effort == "none"
    hello = [{"role": "user", "content": "Hello"}]
    assert got.output_text == chat_text(q3, hello, 4, model="qwen3", reasoning_effort="none")[0]
    with pytest.raises(openai.BadRequestError) as err:  # the chat path's refusal: no reasoning switch
        vl.responses.create(model="tiny-default", **ask)
    assert "reasoning_effort" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        q3.responses.create(model="qwen3", **{**ask, "reasoning": {"effort": "low", "summary": "auto"}})
    assert "reasoning.summary: not supported" in err.value.body["message"]


def test_concurrent_clients_get_their_solo_answers(vl):
    asks = [image_input(f"{QUESTION}{'?' * i}") if i % 2 else f"Tell me a story number {i}" for i in range(8)]
    solo = [vl.responses.create(model="tiny-default", input=a, max_output_tokens=8).output_text for a in asks]
    with ThreadPoolExecutor(8) as pool:
        together = list(
            pool.map(lambda a: vl.responses.create(model="tiny-default", input=a, max_output_tokens=8), asks)
        )
    assert [r.output_text for r in together] == solo


# --- the tiny Qwen3: tools and structured output ------------------------------------------------


def test_forced_function_call_and_its_output_round_trip(q3):
    question = {"role": "user", "content": "What's the weather in Oslo?"}
    forced = dict(model="qwen3", tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"})
    asked = q3.responses.create(input=[question], max_output_tokens=200, **forced)
    assert [item.type for item in asked.output] == ["function_call"], asked.output
    call = asked.output[0]
    assert call.name == "get_weather" and set(json.loads(call.arguments)) == {"city", "unit"}
    chat = q3.chat.completions.create(
        model="qwen3",
        messages=[question],
        tools=[CHAT_WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=200,
    ).choices[0]
    assert answer(asked) == (None, [(c.function.name, c.function.arguments) for c in chat.message.tool_calls])

    with q3.responses.stream(input=[question], max_output_tokens=200, **forced) as stream:
        kinds = [e.type for e in stream]
        streamed = stream.get_final_response()
    assert "response.function_call_arguments.done" in kinds and answer(streamed) == answer(asked)

    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"celsius": 3}'}
    followed = q3.responses.create(
        model="qwen3", tools=[WEATHER], previous_response_id=asked.id, input=[result], max_output_tokens=8
    )
    echoed = [question, call.model_dump(exclude_none=True), result]  # the same, the items sent back by hand
    by_hand = q3.responses.create(model="qwen3", tools=[WEATHER], input=echoed, max_output_tokens=8)
    messages = [
        question,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": '{"celsius": 3}'},
    ]
    chat = q3.chat.completions.create(model="qwen3", messages=messages, tools=[CHAT_WEATHER], max_tokens=8).choices[0]
    expected = (chat.message.content, [(c.function.name, c.function.arguments) for c in chat.message.tool_calls or []])
    assert answer(followed) == answer(by_hand) == expected
    assert followed.usage.input_tokens > asked.usage.input_tokens + asked.usage.output_tokens


def test_text_format_json_schema_parses(q3):
    got = q3.responses.parse(model="qwen3", input="A shape?", text_format=Shape, max_output_tokens=64)
    assert isinstance(got.output_parsed, Shape)
    assert got.text.format.type == "json_schema"
