"""The JSON Schema of each task kind's params and the tables of docs/protocol.md, rendered from
the declared types (``protocols/payloads/task_kinds.py``): nothing here restates a field.

``python -m protocols.task_params_schema`` writes ``protocols/schema/task_params/<kind>.schema.json``
and prints the tables to paste into docs/protocol.md; tests/test_task_params_contract.py fails
when either is stale. The schema says each field's JSON type, which fields a task must name and
the defaults; the ranges are the types' own checks (``from_params`` is the validator, the schema
its description for other implementations).
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from pathlib import Path
from typing import Any

from .payloads.task_kinds import TASK_PARAMS
from .payloads.task_params import CHOICES, NESTED, PART, PARAMS_VERSION, VERSION_KEY, WireParams, to_json

SCHEMA_DIR = Path(__file__).resolve().parent / "schema" / "task_params"
_SCALARS = {int: "integer", float: "number", bool: "boolean", str: "string", dict: "object"}


def _json_type(annotation: Any) -> dict:
    """The JSON Schema of one Python annotation (int, float | None, tuple[str, ...], a WireParams)."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        return {"anyOf": [_json_type(inner[0]), {"type": "null"}]}
    if isinstance(annotation, type) and issubclass(annotation, WireParams):
        return object_schema(annotation)
    if annotation is tuple or typing.get_origin(annotation) is tuple:
        items = [a for a in args if a is not Ellipsis]
        return {"type": "array", **({"items": _json_type(items[0])} if items else {})}
    if annotation in _SCALARS:
        return {"type": _SCALARS[annotation]}
    raise TypeError(f"no JSON Schema for {annotation!r}")


def _fields(cls: type) -> list[tuple[str, dict, bool, Any]]:
    """(wire key, schema, required, default) of every field that travels flat, parts expanded."""
    hints = typing.get_type_hints(cls)
    required = set(cls.required_keys())
    out = []
    for f in dataclasses.fields(cls):
        if PART in f.metadata:
            out.extend(_fields(f.metadata[PART]))
            continue
        schema = object_schema(f.metadata[NESTED]) if NESTED in f.metadata else _json_type(hints[f.name])
        if CHOICES in f.metadata:
            schema = {**schema, "enum": list(f.metadata[CHOICES])}
        if NESTED in f.metadata and f.default is None:
            schema = {"anyOf": [schema, {"type": "null"}]}
        default = (f.default if f.default is not dataclasses.MISSING else
                   f.default_factory() if f.default_factory is not dataclasses.MISSING else dataclasses.MISSING)
        out.append((f.name, schema, f.name in required, to_json(default)))
    return out


def object_schema(cls: type) -> dict:
    fields = _fields(cls)
    schema: dict[str, Any] = {"type": "object", "properties": {}}
    for key, field_schema, _, default in fields:
        if default is not dataclasses.MISSING and default is not None:
            field_schema = {**field_schema, "default": default}
        schema["properties"][key] = field_schema
    schema["required"] = [key for key, _, required, _ in fields if required]
    return schema


def kind_schema(kind: str) -> dict:
    cls = TASK_PARAMS[kind]
    body = object_schema(cls)
    body["properties"][VERSION_KEY] = {"const": PARAMS_VERSION, "description": "absent: 1"}
    doc = " ".join((cls.__doc__ or "").split())
    return {"$schema": "https://json-schema.org/draft/2020-12/schema",
            "$id": f"https://fedfleet.dev/schema/task-params/{kind}-v{PARAMS_VERSION}.json",
            "title": f"params of a {kind} task (fedfleet, params version {PARAMS_VERSION})",
            "description": f"{doc} Rendered from {cls.__module__}.{cls.__name__}; unknown keys are ignored.",
            **body}


def render_schema(kind: str) -> str:
    return json.dumps(kind_schema(kind), indent=2, ensure_ascii=False, sort_keys=False) + "\n"


def _type_word(schema: dict) -> str:
    if "anyOf" in schema:
        return " or ".join(_type_word(s) for s in schema["anyOf"])
    if schema.get("type") == "array" and "items" in schema:
        return f"array of {_type_word(schema['items'])}"
    if "enum" in schema:
        return f"{schema['type']}: " + " \\| ".join(schema["enum"])     # \| : a bar inside a markdown table
    return schema.get("type", "?")


def render_table(kind: str) -> str:
    cls = TASK_PARAMS[kind]
    rows = [f"`{kind}` ({cls.__module__}.{cls.__name__})", "", "| param | type | required | default |",
            "|---|---|---|---|"]
    for key, schema, required, default in _fields(cls):
        shown = "" if default is dataclasses.MISSING or required else json.dumps(default, ensure_ascii=False)
        rows.append(f"| `{key}` | {_type_word(schema)} | {'yes' if required else ''} | {shown} |")
    return "\n".join(rows)


def render_tables() -> str:
    """Every kind's params table, as docs/protocol.md shows them."""
    return "\n\n".join(render_table(kind) for kind in sorted(TASK_PARAMS))


def write_schemas(directory: Path = SCHEMA_DIR) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for kind in TASK_PARAMS:
        (directory / f"{kind}.schema.json").write_text(render_schema(kind))


if __name__ == "__main__":
    write_schemas()
    print(render_tables())
