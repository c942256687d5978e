"""OpenAI's ``response_format`` and vLLM's ``structured_outputs``, as ``Request`` constraint fields.

One place for the mapping: the server's requests and ``mode=batch`` lines (``response_format``)
go through it, and the CLI's ``decode.json_schema / regex / choice / grammar`` settings through
``cli_constraint``. The constraint itself is checked when the request is submitted
(``pipeline.runner.grammar``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from pipeline.errors import UserError

ANY_OBJECT = {"type": "object"}
STRUCTURED_OUTPUTS = {
    "json": "json_schema",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
    "structural_tag": "structural_tag",
    "json_object": "json_schema",
}
CLI_FIELDS = ("json_schema", "regex", "choice", "grammar")


def from_response_format(value: Any, where: str = "response_format") -> dict:
    """``{"type": "text" | "json_object" | "json_schema" | "structural_tag", ...}`` -> Request fields."""
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise UserError(f'{where} must be an object with a "type" (text, json_object, json_schema)')
    kind = value["type"]
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_schema": ANY_OBJECT}
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not spec["name"]:
            raise UserError(f'{where}.json_schema must be an object with a "name" and a "schema"')
        schema = spec.get("schema", ANY_OBJECT)
        if not isinstance(schema, dict):
            raise UserError(f"{where}.json_schema.schema must be a JSON Schema object")
        return {"json_schema": schema}
    if kind == "structural_tag":
        return {"structural_tag": value}
    raise UserError(f"{where}.type must be text, json_object, json_schema or structural_tag (got {kind!r})")


def from_structured_outputs(value: Any, where: str = "structured_outputs") -> dict:
    """vLLM's ``{"json" | "regex" | "choice" | "grammar" | "json_object" | "structural_tag": ...}``."""
    if not isinstance(value, dict):
        raise UserError(f"{where} must be an object with one of: {', '.join(STRUCTURED_OUTPUTS)}")
    given = {k: v for k, v in value.items() if v is not None and v is not False}
    unknown = sorted(set(given) - set(STRUCTURED_OUTPUTS))
    if unknown:
        raise UserError(f"{where}: unknown field {unknown[0]!r} (allowed: {', '.join(STRUCTURED_OUTPUTS)})")
    if len(given) != 1:
        raise UserError(f"{where} takes exactly one of: {', '.join(STRUCTURED_OUTPUTS)}")
    key, spec = next(iter(given.items()))
    return {STRUCTURED_OUTPUTS[key]: ANY_OBJECT if key == "json_object" else spec}


def cli_constraint(decode: Any) -> dict:
    """``decode.json_schema`` (a .json file, inline JSON text, or a mapping), ``decode.regex``,
    ``decode.choice`` (a list) and ``decode.grammar`` (EBNF text or a file) -> Request fields."""
    out = {}
    for name in CLI_FIELDS:
        value = decode.get(name)
        if OmegaConf.is_config(value):
            value = OmegaConf.to_container(value, resolve=True)
        elif name in ("json_schema", "grammar") and isinstance(value, str) and _is_file(value):
            value = Path(value).expanduser().read_text()
        if value is not None:
            out[name] = value
    return out


def _is_file(value: str) -> bool:
    """A path rather than inline text (a missing file with a usual suffix is an error, not text)."""
    text = value.strip()
    if not text or text[0] in "{[" or "::=" in text:
        return False
    path = Path(text).expanduser()
    if path.suffix in (".json", ".ebnf", ".gbnf", ".txt") and not path.is_file():
        raise UserError(f"{value}: no such file")
    return path.is_file()
