"""Tool calling: which syntax a model calls tools in, the grammar that enforces a call, and
reading calls (and a thinking model's reasoning) back out of its text.

Formats (xgrammar's structural-tag names): ``qwen_3`` (Hermes: ``<tool_call>{"name", "arguments"}
</tool_call>``, Qwen2.5/Qwen3/Qwen3-VL), ``qwen_3_5`` (Qwen3.5's XML: ``<function=NAME><parameter=P>
value</parameter></function>``), ``llama`` (Llama 3.1: ``{"name", "parameters"}``). The model's own
chat template renders ``tools``, calls and results when it can; for a template without tool
support (Qwen2-VL, Qwen2-Audio, Gemma 3, Llama 3.0) the tools go into the system message in the
format's published wording, calls into the assistant text and results into user turns.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from pipeline.errors import UserError
from pipeline.runner.grammar import THINK, check_schema, plain_bounded_strings, xgrammar

HERMES, XML, LLAMA = "qwen_3", "qwen_3_5", "llama"
ARGUMENT_KEYS = {HERMES: "arguments", LLAMA: "parameters"}
_XML_FUNCTION = re.compile(r"\s*<function=([^>\s]+)>")
# A value's one whitespace character on each side is layout (the template writes "\n"; the grammar allows one).
_XML_PARAM = re.compile(r"<parameter=([^>\s]+)>\s?(.*?)\s?</parameter>", re.S)


def tool_format(template: str | None, vocab: dict) -> str:
    """The syntax this model calls tools in, read off its chat template (and vocabulary)."""
    source = template or ""
    if "<function=" in source:
        return XML
    if "<tool_call>" in source or "<tool_call>" in vocab:
        return HERMES
    if "<|python_tag|>" in source or "<|python_tag|>" in vocab:
        return LLAMA
    return HERMES


def renders_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template


def check_tools(tools: Any, tool_choice: Any) -> tuple[list[dict], Any]:
    """OpenAI ``tools`` / ``tool_choice`` checked: every tool a function with a name and an object
    schema; a named choice names one of them. Returns (tools, choice: none | auto | required | name)."""
    if not isinstance(tools, list) or not tools:
        raise UserError("tools must be a non-empty list of {type: function, function: {name, parameters}}")
    names = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise UserError(f"tools[{i}] must be {{type: function, function: {{name, parameters}}}}")
        if not isinstance(fn.get("name"), str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", fn["name"]):
            raise UserError(f"tools[{i}].function.name is missing or not a valid name (letters, digits, _ . -)")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise UserError(f"tools[{i}].function.parameters must be a JSON Schema object")
        names.append(fn["name"])
    choice = "auto" if tool_choice is None else tool_choice
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if name not in names:
            raise UserError(f"tool_choice names the function {name!r}, which is not in tools ({', '.join(names)})")
        return tools, name
    if choice not in ("none", "auto", "required"):
        raise UserError(
            f"tool_choice must be none, auto, required or {{type: function, function: {{name}}}} (got {choice!r})"
        )
    return tools, choice


def call_grammar(fmt: str, tools: list[dict], choice: str, parallel: bool) -> dict | None:
    """The structural tag that enforces a call (``required`` or a named function; None otherwise):
    arguments valid against the function's parameter schema, in the model's own syntax."""
    if choice in ("none", "auto"):
        return None
    xgr = xgrammar()
    pick = "required" if choice == "required" else {"type": "function", "function": {"name": choice}}
    checked = []
    for i, tool in enumerate(tools):
        params = tool["function"].get("parameters")
        if params is not None:
            check_schema(params, f"tools[{i}].function.parameters")
            tool = {**tool, "function": {**tool["function"], "parameters": plain_bounded_strings(params)}}
        checked.append(tool)
    try:
        tag = xgr.get_model_structural_tag(
            fmt,
            tools=checked,
            tool_choice=pick,
            reasoning="disabled",
            parallel_tool_calls=parallel,
            max_whitespace_cnt=1,
        )
        return _compact(tag.model_dump(), xgr)
    except Exception as err:
        raise UserError(f"tools: {err}") from None


def _compact(node: Any, xgr: Any) -> Any:
    """The tag as the API means it, for any model: JSON arguments written compactly (as
    ``Request.json_schema`` is; xgrammar's tags allow whitespace between every token, which a weak
    model pads without end), and ``required`` as calls only, no free text after them."""
    if isinstance(node, list):
        return [_compact(n, xgr) for n in node]
    if not isinstance(node, dict):
        return node
    if node.get("type") == "json_schema" and node.get("style", "json") == "json":
        return {
            "type": "grammar",
            "grammar": str(xgr.Grammar.from_json_schema(node["json_schema"], any_whitespace=False)),
        }
    if node.get("type") == "triggered_tags":  # required: calls only, no text around them (OpenAI's meaning)
        sep = "\n" if node["tags"] and node["tags"][0]["begin"].startswith("<") else "; "
        return {
            "type": "tags_with_separator",
            "tags": _compact(node["tags"], xgr),
            "separator": sep,
            "at_least_one": True,
            "stop_after_first": node.get("stop_after_first", False),
        }
    return {k: _compact(v, xgr) for k, v in node.items()}


# --- rendering for templates without tool support -------------------------------------------
def fallback_messages(messages: list[dict], tools: list[dict], fmt: str) -> list[dict]:
    """The conversation for a template that cannot render tools: their description in the system
    message, calls as assistant text, results as user turns (what Qwen2.5's template writes)."""
    out = [dict(m) for m in messages]
    if tools:
        described = _describe(tools, fmt)
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{_text(out[0]['content'])}\n\n{described}"
        else:
            out.insert(0, {"role": "system", "content": described})
    rendered = []
    for m in out:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = "\n".join(
                format_call(c["function"]["name"], c["function"]["arguments"], fmt) for c in m["tool_calls"]
            )
            rendered.append({"role": "assistant", "content": "\n".join(filter(None, [_text(m.get("content")), calls]))})
        elif m["role"] == "tool":
            reply = f"<tool_response>\n{_text(m.get('content'))}\n</tool_response>"
            if _after_results(rendered):
                rendered[-1]["content"] += "\n" + reply
            else:
                rendered.append({"role": "user", "content": reply, "tool_results": True})
        elif m["role"] == "user" and _after_results(rendered):  # one user turn (Gemma's roles alternate)
            rendered[-1] = {"role": "user", "content": _joined(rendered[-1]["content"], m.get("content"))}
        else:
            rendered.append(m)
    return [{k: v for k, v in m.items() if k != "tool_results"} for m in rendered]


def _after_results(rendered: list[dict]) -> bool:
    return bool(rendered) and rendered[-1]["role"] == "user" and bool(rendered[-1].get("tool_results"))


def _joined(first: str, then: Any) -> Any:
    """A user message's content after the tool results: as text, or as parts when it has media."""
    if not isinstance(then, list):
        return f"{first}\n\n{_text(then)}"
    return [{"type": "text", "text": first + "\n\n"}, *then]


def _describe(tools: list[dict], fmt: str) -> str:
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    if fmt == LLAMA:
        return (
            "Given the following functions, please respond with a JSON for a function call with its proper "
            'arguments that best answers the given prompt.\n\nRespond in the format {"name": function name, '
            '"parameters": dictionary of argument name and its value}. Do not use variables.\n\n' + listed
        )
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with "
        f"function signatures within <tools></tools> XML tags:\n<tools>\n{listed}\n</tools>\n\nFor each function "
        "call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def format_call(name: str, arguments: Any, fmt: str) -> str:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    if fmt == LLAMA:
        return f'{{"name": "{name}", "parameters": {args}}}'
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if isinstance(p, dict))


def template_messages(messages: list[dict]) -> list[dict]:
    """Calls' ``arguments`` as objects for templates that write them with ``tojson`` (Llama's)."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = [
                {**c, "function": {**c["function"], "arguments": _loads(c["function"]["arguments"])}}
                for c in m["tool_calls"]
            ]
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out


def _loads(text: Any) -> Any:
    if not isinstance(text, str):
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


# --- reading the answer ---------------------------------------------------------------------
@dataclass
class Call:
    name: str
    arguments: str  # JSON text, as generated (complete or, while streaming, so far)
    complete: bool
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])


@dataclass
class Parsed:
    reasoning: str | None
    content: str
    calls: list[Call]


def split_reasoning(text: str, opened: bool, streaming: bool = False) -> tuple[str | None, str]:
    """(reasoning, rest) when the answer is a think block first (``opened``: the prompt began it).
    ``streaming``: ``text`` is a stream so far; what may be a tag arriving is held back."""
    body = text.lstrip()
    if not opened and not body.startswith(THINK[0]):
        if streaming and body and THINK[0].startswith(body):
            return "", ""  # "<thi": the reasoning may be starting
        return None, text
    if body.startswith(THINK[0]):
        body = body[len(THINK[0]) :]
    reasoning, sep, rest = body.partition(THINK[1])
    if not sep:
        return (_hold_back(reasoning, THINK[1]) if streaming else reasoning).strip("\n"), ""
    return reasoning.strip("\n"), rest.lstrip("\n")


def parse(
    text: str, fmt: str | None, opened: bool = False, params: dict | None = None, streaming: bool = False
) -> Parsed:
    """Reasoning, content and tool calls (``fmt`` None: no tools asked) in ``text``. ``streaming``:
    ``text`` is a stream so far; a call still being written comes back with ``complete`` False,
    and what may still change (text that may begin a call or a tag, trailing whitespace, which the
    whole answer drops before a call) is held back, so each streamed value only grows."""
    reasoning, rest = split_reasoning(text, opened, streaming)
    if reasoning is not None and THINK[1] not in text:
        return Parsed(reasoning, "", [])
    if fmt is None:
        content, calls = rest, []
    elif fmt == LLAMA:
        content, calls = _llama_calls(rest, streaming)
    elif fmt == XML:
        content, calls = _xml_calls(rest, params or {}, streaming)
    else:
        content, calls = _hermes_calls(rest, streaming)
    return Parsed(reasoning, content.rstrip() if streaming else content, calls)


def _hermes_calls(text: str, streaming: bool) -> tuple[str, list[Call]]:
    head, tag, tail = text.partition("<tool_call>")
    content = _hold_back(head, "<tool_call>") if streaming and not tag else head
    calls = []
    while tag:
        body, tag_end, after = tail.partition("</tool_call>")
        call = _json_call(body, "arguments", complete=bool(tag_end))
        if call is not None:
            calls.append(call)
        _, tag, tail = after.partition("<tool_call>")
    return content.rstrip() if calls else content, calls


def _llama_calls(text: str, streaming: bool) -> tuple[str, list[Call]]:
    """Llama 3.1: the answer is the call(s), ``{"name": N, "parameters": {...}}``, ``;``-separated."""
    body = text.lstrip().removeprefix("<|python_tag|>").lstrip()
    start = '{"name"'
    if not body.startswith(start):
        return ("" if streaming and body and start.startswith(body) else text), []
    calls, pos = [], 0
    while pos < len(body):
        chunk = body[pos:]
        end = _value_end(chunk)
        call = _json_call(chunk if end is None else chunk[:end], "parameters", complete=end is not None)
        if call is not None:
            calls.append(call)
        if end is None:
            break
        rest = chunk[end:]
        pos += end + len(rest) - len(rest.lstrip().lstrip(";").lstrip())
    return "", calls


def _xml_calls(text: str, params: dict, streaming: bool) -> tuple[str, list[Call]]:
    """Qwen3.5: ``<tool_call><function=NAME><parameter=P>value</parameter>...</function></tool_call>``.
    The arguments become a JSON object that grows one finished parameter at a time (values typed
    by the function's schema: a ``string`` parameter is its text, anything else JSON)."""
    head, tag, _ = text.partition("<tool_call>")
    if not tag:
        return (_hold_back(head, "<tool_call>") if streaming else head), []
    calls = []
    for block in text.split("<tool_call>")[1:]:
        opened = _XML_FUNCTION.match(block)
        if opened is None:
            break  # the function's name is still being written
        name = opened.group(1)
        body, end, _ = block[opened.end() :].partition("</function>")
        types = (params.get(name) or {}).get("properties", {})
        fields = [
            f"{json.dumps(k, ensure_ascii=False)}: {_xml_value(v, types.get(k))}" for k, v in _XML_PARAM.findall(body)
        ]
        calls.append(Call(name, "{" + ", ".join(fields) + ("}" if end else ""), bool(end)))
    return head.rstrip(), calls


def _xml_value(text: str, schema: Any) -> str:
    return json.dumps(text if _is_string(schema) else _loads(text), ensure_ascii=False)


def _is_string(schema: Any) -> bool:
    """A parameter whose value is text as written: typed ``string``, or an enum / const of strings."""
    if not isinstance(schema, dict):
        return False
    values = schema.get("enum", [schema["const"]] if "const" in schema else None)
    kind = schema.get("type")
    return kind == "string" or (kind is None and bool(values) and all(isinstance(v, str) for v in values))


_CALL_HEAD = {
    key: re.compile(r'\s*\{\s*"name"\s*:\s*"([^"]+)"\s*,\s*"' + key + r'"\s*:\s*')
    for key in ("arguments", "parameters")
}


def _json_call(body: str, key: str, complete: bool) -> Call | None:
    """``{"name": N, key: ARGS}`` (ARGS so far while it is written)."""
    head = _CALL_HEAD[key].match(body)
    if head is None:
        return None
    rest = body[head.end() :]
    end = _value_end(rest)
    args = rest[:end] if end is not None else rest.rstrip()
    return Call(head.group(1), args, complete and end is not None)


def _value_end(text: str) -> int | None:
    """Where the JSON value at the start of ``text`` ends (None: not yet)."""
    try:
        _, end = json.JSONDecoder().raw_decode(text)
    except json.JSONDecodeError:
        return None
    return end


def _hold_back(text: str, tag: str) -> str:
    """``text`` without a trailing partial ``tag`` (it may be a call starting)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return text[:-k]
    return text
