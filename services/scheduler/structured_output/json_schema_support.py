"""Which JSON-schema keywords xgrammar enforces, so that a schema it would silently weaken is
refused (a 400) instead of producing output that fails the schema.

xgrammar compiles most of JSON Schema into its grammar. A few keywords it accepts but does
not enforce (checked against xgrammar 0.2: a violating document still matches); a schema
using one is reported here with its path. The regexes of `pattern` keywords are listed too:
xgrammar ignores a pattern its regex parser cannot read, so the backend parses each one
first (services/scheduler/structured_output/grammar.py).

One gap has a fix instead: xgrammar's rule for a string with minLength / maxLength lets raw
control characters through (invalid JSON). The backend patches that rule in the grammar
xgrammar prints (grammar.py); where it cannot (a structural tag's schemas, or a grammar text
that does not compile back), `with_length_patterns` spells the lengths as a pattern, which
xgrammar matches as a proper JSON string, at about 100x the compile time.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

# Keywords whose value is a schema, a map of name -> schema, or a list of schemas.
_SCHEMA_KEYWORDS = (
    "additionalProperties",
    "items",
    "additionalItems",
    "propertyNames",
    "unevaluatedProperties",
    "unevaluatedItems",
    "contains",
    "not",
    "if",
    "then",
    "else",
)
_SCHEMA_MAP_KEYWORDS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_LIST_KEYWORDS = ("anyOf", "oneOf", "allOf", "prefixItems")

# Keyword -> what to say; each is accepted by xgrammar and not enforced.
_NOT_ENFORCED = {
    "contains": "contains",
    "minContains": "minContains",
    "maxContains": "maxContains",
    "not": "not",
    "if": "if/then/else",
    "then": "if/then/else",
    "else": "if/then/else",
    "dependentRequired": "dependentRequired",
    "dependentSchemas": "dependentSchemas",
    "dependencies": "dependencies",
}


def walk_schemas(schema: Any, path: str = "#") -> Iterator[tuple[str, dict[str, Any]]]:
    """Every (sub)schema that is an object, with its JSON-pointer path, parents first."""
    if not isinstance(schema, dict):
        return  # a boolean schema, or a malformed value the meta-schema check reports
    yield path, schema
    for keyword in _SCHEMA_KEYWORDS:
        if keyword in schema:
            yield from walk_schemas(schema[keyword], f"{path}/{keyword}")
    for keyword in _SCHEMA_MAP_KEYWORDS:
        members = schema.get(keyword)
        if isinstance(members, dict):
            for name, member in members.items():
                yield from walk_schemas(member, f"{path}/{keyword}/{name}")
    for keyword in _SCHEMA_LIST_KEYWORDS:
        members = schema.get(keyword)
        if isinstance(members, list):
            for index, member in enumerate(members):
                yield from walk_schemas(member, f"{path}/{keyword}/{index}")


def unsupported_features(schema: Any) -> list[str]:
    """ "path: why" for each keyword of `schema` that xgrammar would not enforce."""
    problems = []
    for path, node in walk_schemas(schema):
        for keyword, name in _NOT_ENFORCED.items():
            if keyword in node:
                problems.append(f"{path}: {name} is not supported")
        if node.get("uniqueItems") is True:
            problems.append(f"{path}: uniqueItems is not supported")
        all_of = node.get("allOf")
        if isinstance(all_of, list) and len(all_of) > 1:
            problems.append(f"{path}: allOf with several schemas is not supported (merge them)")
        if "multipleOf" in node and not _is_integer_multiple(node):
            problems.append(f"{path}: multipleOf is supported for integers only")
        if isinstance(node.get("oneOf"), list) and not _disjoint(node["oneOf"]):
            problems.append(
                f"{path}: oneOf whose branches may overlap is not supported (xgrammar reads "
                f"it as anyOf; use anyOf, or tell the branches apart by a const property)"
            )
        problems.extend(_unlisted_required(path, node))
        if ("minLength" in node or "maxLength" in node) and ("pattern" in node or "format" in node):
            problems.append(
                f"{path}: minLength / maxLength together with pattern or format is not "
                f"supported (put the length into the pattern)"
            )
    return problems


def with_length_patterns(schema: Any) -> Any:
    """A copy of `schema` where each string length bound (minLength / maxLength, without a
    pattern or format) is a pattern of as many non-control characters instead."""
    schema = copy.deepcopy(schema)
    for _, node in walk_schemas(schema):
        if ("minLength" in node or "maxLength" in node) and not (
            "pattern" in node or "format" in node
        ):
            # The bounds move into the pattern (xgrammar ignores them beside one).
            low, high = node.pop("minLength", 0), node.pop("maxLength", "")
            node["pattern"] = f"^[^\\x00-\\x1f]{{{low},{high}}}$"
    return schema


def schema_patterns(schema: Any) -> list[tuple[str, str]]:
    """(path, regex) of every `pattern` and `patternProperties` key in `schema`."""
    patterns = []
    for path, node in walk_schemas(schema):
        if isinstance(node.get("pattern"), str):
            patterns.append((f"{path}/pattern", node["pattern"]))
        if isinstance(node.get("patternProperties"), dict):
            for regex in node["patternProperties"]:
                patterns.append((f"{path}/patternProperties", regex))
    return patterns


def _is_integer_multiple(node: dict[str, Any]) -> bool:
    value = node["multipleOf"]
    return node.get("type") == "integer" and isinstance(value, int) and value > 0


def _unlisted_required(path: str, node: dict[str, Any]) -> list[str]:
    # xgrammar only enforces required keys that `properties` describes.
    required = node.get("required")
    if not isinstance(required, list):
        return []
    properties = node.get("properties")
    listed = properties if isinstance(properties, dict) else {}
    return [
        f"{path}: required property {name!r} must be listed in properties"
        for name in required
        if name not in listed
    ]


def _disjoint(branches: list[Any]) -> bool:
    """True when no JSON value can match two branches: each has another single type (number
    and integer overlap), or all are objects told apart by one required const property."""
    types = [b.get("type") if isinstance(b, dict) else None for b in branches]
    if all(isinstance(t, str) for t in types):
        kinds = ["number" if t == "integer" else t for t in types]
        if len(set(kinds)) == len(kinds):
            return True
    return _discriminated(branches)


def _discriminated(branches: list[Any]) -> bool:
    if not all(isinstance(b, dict) and isinstance(b.get("properties"), dict) for b in branches):
        return False
    shared = set.intersection(*(set(b.get("required", ())) for b in branches))
    for name in shared:
        seen: list[Any] = []
        for branch in branches:
            values = _const_values(branch["properties"].get(name))
            if values is None or any(v in seen for v in values):
                break
            seen.extend(values)
        else:
            return True
    return False


def _const_values(schema: Any) -> list[Any] | None:
    if not isinstance(schema, dict):
        return None
    if "const" in schema:
        return [schema["const"]]
    if isinstance(schema.get("enum"), list):
        return list(schema["enum"])
    return None
