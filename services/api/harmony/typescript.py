"""A function's JSON schema as harmony's developer message writes it: TypeScript types in
the `functions` namespace, as openai-harmony renders them.

    // Gets the weather.
    type get_weather = (_: {
    // The city
    city: string,
    unit?: "c" | "f", // default: c
    }) => any;
"""

from __future__ import annotations

import json
from typing import Any


def functions_namespace(tools: list[dict[str, Any]]) -> str:
    """The developer message's `## functions` section for OpenAI-shaped tools."""
    lines = ["## functions", "", "namespace functions {", ""]
    for tool in tools:
        function = tool.get("function") or {}
        if function.get("description"):
            lines.extend(f"// {line}" for line in str(function["description"]).splitlines())
        lines.append(_function_type(function.get("name", ""), function.get("parameters")))
        lines.append("")
    lines.append("} // namespace functions")
    return "\n".join(lines)


def _function_type(name: str, parameters: dict[str, Any] | None) -> str:
    properties = (parameters or {}).get("properties") or {}
    if not properties:
        return f"type {name} = () => any;"
    return f"type {name} = (_: {_object_body(parameters or {})}) => any;"


def _object_body(schema: dict[str, Any]) -> str:
    required = set(schema.get("required") or ())
    lines = ["{"]
    for key, prop in (schema.get("properties") or {}).items():
        prop = prop if isinstance(prop, dict) else {}
        if prop.get("description"):
            lines.extend(f"// {line}" for line in str(prop["description"]).splitlines())
        optional = "" if key in required else "?"
        default = f" // default: {_literal(prop['default'])}" if "default" in prop else ""
        lines.append(f"{key}{optional}: {type_of(prop)},{default}")
    lines.append("}")
    return "\n".join(lines)


def type_of(schema: dict[str, Any]) -> str:
    """One schema as a TypeScript type (any where the schema says nothing)."""
    if "enum" in schema:
        return " | ".join(json.dumps(value) for value in schema["enum"])
    branches = schema.get("anyOf") or schema.get("oneOf")
    if branches:
        return " | ".join(type_of(branch) for branch in branches if isinstance(branch, dict))
    kind = schema.get("type")
    if isinstance(kind, list):
        return " | ".join(type_of({**schema, "type": k}) for k in kind)
    if kind in ("integer", "number"):
        return "number"
    if kind in ("string", "boolean", "null"):
        return str(kind)
    if kind == "array":
        items = schema.get("items")
        return f"{type_of(items) if isinstance(items, dict) else 'any'}[]"
    if kind == "object" and schema.get("properties"):
        return _object_body(schema)
    return "object" if kind == "object" else "any"


def _literal(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)
