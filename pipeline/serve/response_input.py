"""The Responses API's request (``ResponsesRequest``) and what it becomes: a chat completion
request (instructions, input items, flat function tools, ``text.format``, ``reasoning``).
"""

from __future__ import annotations

import json
from typing import Any, Literal, Union

from pydantic import Field, ValidationError

from pipeline.serve.protocol import APIError, Body, ChatCompletionRequest

ROLES = ("user", "system", "developer", "assistant")


class ResponsesRequest(Body):
    """OpenAI's ``POST /v1/responses`` body, as far as this server implements it (other top-level
    fields: a 400 naming them, ``HARMLESS`` ones aside)."""

    input: Union[str, list[dict[str, Any]]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    previous_response_id: str | None = None
    store: bool | None = True
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["disabled"] | None = None  # "auto" (dropping earlier turns) is not implemented


def _bad(message: str, code: str = "invalid_value") -> APIError:
    return APIError(400, message, code=code)


# --- the request as a chat completion ----------------------------------------------------------


def chat_content(content: Any, where: str, role: str) -> Any:
    """A Responses message's content in the chat shape: a string, or parts (``input_text`` /
    ``output_text`` as text, ``input_image`` as ``image_url``, ``input_audio``); an assistant's
    text parts joined into one string, as the chat answer it echoes was."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where}.content must be a string or a list of content parts")
    parts: list[dict] = []
    for p, part in enumerate(content):
        at = f"{where}.content[{p}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text"):
            if not isinstance(part.get("text"), str):
                raise _bad(f"{at}.text must be a string")
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "refusal":
            parts.append({"type": "text", "text": str(part.get("refusal") or "")})
        elif kind == "input_image":
            if not isinstance(part.get("image_url"), str):
                raise _bad(f"{at}: an input_image needs image_url (a data: URI; file_id is not supported)")
            image = {"url": part["image_url"], **({"detail": part["detail"]} if part.get("detail") else {})}
            parts.append({"type": "image_url", "image_url": image})
        elif kind == "input_audio":
            parts.append({"type": "input_audio", "input_audio": part.get("input_audio")})
        else:
            raise _bad(f"{at}: content parts of type {kind!r} are not supported (input_text, input_image, input_audio)")
    if role == "assistant" and all(part["type"] == "text" for part in parts):
        return "".join(part["text"] for part in parts)
    return parts


def tool_output(output: Any, where: str) -> str:
    """A ``function_call_output``'s output as the tool message's text."""
    if isinstance(output, str):
        return output
    if isinstance(output, list) and all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in output):
        return "".join(p["text"] for p in output)
    raise _bad(f"{where}.output must be a string or a list of input_text parts")


def input_messages(items: Any) -> list[dict]:
    """The ``input`` as chat messages: a string is one user message; items are messages,
    ``function_call`` (an assistant's call: joined to the assistant message just before it) and
    ``function_call_output`` (a tool message); ``reasoning`` items are left out, as a chat client
    leaves earlier reasoning out."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not items:
        raise _bad("input is empty")
    messages: list[dict] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise _bad(f"{where}.role must be one of {', '.join(ROLES)} (got {role!r})")
            messages.append({"role": role, "content": chat_content(item.get("content"), where, role)})
        elif kind == "function_call":
            if not isinstance(item.get("call_id"), str) or not isinstance(item.get("name"), str):
                raise _bad(f"{where}: a function_call needs call_id and name")
            arguments = item.get("arguments") or "{}"
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": arguments},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and isinstance(last["content"], (str, type(None))):
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise _bad(f"{where}: a function_call_output needs call_id")
            output = tool_output(item.get("output"), where)
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
        elif kind == "reasoning":
            continue
        else:
            raise _bad(
                f"{where}: input items of type {kind!r} are not supported "
                "(message, function_call, function_call_output, reasoning)",
                "unsupported_parameter",
            )
    return messages


def chat_tools(tools: list[dict] | None) -> list[dict] | None:
    """Responses' flat function tools (``{type, name, description, parameters, strict}``) in the
    chat shape; other tool types (built-in tools this server does not run) refused."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise _bad(
                f"tools[{i}]: tools of type {tool.get('type')!r} are not supported (function tools only)",
                "unsupported_parameter",
            )
        if not isinstance(tool.get("name"), str):
            raise _bad(f"tools[{i}].name is missing")
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: Any) -> Any:
    """``tool_choice``: none / auto / required as they are, ``{type: function, name}`` in the chat shape."""
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise _bad(
        f"tool_choice must be none, auto, required or {{type: function, name}} (got {json.dumps(choice)})",
        "unsupported_parameter",
    )


def response_format(text: dict | None) -> dict | None:
    """``text.format`` as the chat ``response_format`` (``text.verbosity`` refused)."""
    if not text:
        return None
    if text.get("verbosity") is not None:
        raise _bad("text.verbosity: not supported by this server", "unsupported_parameter")
    fmt = text.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "description", "strict") if fmt.get(k) is not None}
        return {"type": "json_schema", "json_schema": spec}
    raise _bad(f"text.format.type must be text, json_object or json_schema (got {kind!r})")


def reasoning_effort(reasoning: dict | None) -> dict:
    """``reasoning.effort`` as the chat request's ``reasoning_effort``, where the chat path has it."""
    given = {k: v for k, v in (reasoning or {}).items() if v is not None}
    if not given:
        return {}
    if set(given) == {"effort"} and "reasoning_effort" in ChatCompletionRequest.model_fields:
        return {"reasoning_effort": given["effort"]}
    names = ", ".join(f"reasoning.{k}" for k in sorted(given))
    raise _bad(f"{names}: not supported by this server", "unsupported_parameter")


def chat_request(body: ResponsesRequest, history: list[dict]) -> tuple[ChatCompletionRequest, list[dict]]:
    """The chat completion request this Responses request is, and its conversation (the earlier
    one, then the new input: what a follow-up continues; the instructions are not part of it)."""
    conversation = history + input_messages(body.input)
    system = [{"role": "system", "content": body.instructions}] if body.instructions is not None else []
    fields = {
        "model": body.model,
        "messages": system + conversation,
        "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "tools": chat_tools(body.tools),
        "tool_choice": chat_tool_choice(body.tool_choice),
        "parallel_tool_calls": body.parallel_tool_calls,
        "response_format": response_format(body.text),
        **reasoning_effort(body.reasoning),
    }
    try:
        chat = ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(x) for x in first.get("loc", ()))
        raise _bad(f"{where}: {first.get('msg', 'invalid value')}") from None
    return chat, conversation
