"""What a request constrains its output to: a JSON schema, a regex, a choice, a grammar.

`StructuredOutputsParams` is vLLM's struct of the same name, with the same fields, as it
arrives in a request body (`structured_outputs`) or offline in
`SamplingParams(structured_outputs=...)`. The checks here are the ones any process can make
(exactly one constraint, JSON that parses); the engine core compiles the constraint with
xgrammar and rejects what the backend cannot honour (services/scheduler/structured_output/
grammar.py).
"""

from __future__ import annotations

import json
from typing import Any, Literal

import msgspec

StructuredOutputKind = Literal[
    "json", "regex", "choice", "grammar", "json_object", "structural_tag"
]
_KINDS: tuple[StructuredOutputKind, ...] = (
    "json",
    "regex",
    "choice",
    "grammar",
    "json_object",
    "structural_tag",
)


class StructuredOutputsParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One constraint on a request's output (set exactly one of the first six fields).

    Args:
        json: a JSON schema (a dict, or its JSON text) the output must satisfy.
        regex: a regular expression the whole output must match.
        choice: the output is exactly one of these strings.
        grammar: an EBNF (GBNF) grammar whose `root` rule the output must match.
        json_object: the output is any JSON object.
        structural_tag: xgrammar's structural tag, as JSON text (free text with tagged,
            schema-checked regions).
        disable_any_whitespace: JSON without optional whitespace (compact separators).
        disable_additional_properties: accepted for vLLM's clients: xgrammar never emits
            properties a schema does not list.
        disable_fallback: accepted for vLLM's clients: there is one backend, so no fallback.
        whitespace_pattern: not supported by xgrammar (an error when set).
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    disable_fallback: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        given = [kind for kind in _KINDS if self._value(kind) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of json, regex, choice, grammar, "
                f"json_object and structural_tag, got {given or 'none'}"
            )
        if self.whitespace_pattern is not None:
            raise ValueError("whitespace_pattern is not supported by the xgrammar backend")
        if self.choice is not None and not self.choice:
            raise ValueError("structured_outputs.choice must list at least one string")
        for kind in ("json", "structural_tag"):
            text = self._value(kind)
            if isinstance(text, str):
                try:
                    json.loads(text)
                except ValueError as exc:
                    raise ValueError(
                        f"structured_outputs.{kind} is not valid JSON: {exc}"
                    ) from None
        if isinstance(self.json, str) and not isinstance(json.loads(self.json), (dict, bool)):
            raise ValueError("structured_outputs.json must be a JSON schema (an object)")

    def _value(self, kind: StructuredOutputKind) -> Any:
        return getattr(self, kind)

    @property
    def kind(self) -> StructuredOutputKind:
        """Which constraint is set."""
        return next(kind for kind in _KINDS if self._value(kind) not in (None, False))

    @property
    def spec(self) -> str:
        """The constraint as text: the schema's JSON, the regex, the grammar, the choices as
        a JSON list; "" for json_object."""
        value = self._value(self.kind)
        if isinstance(value, str):
            return value
        if value is True:
            return ""
        # Key order is kept: xgrammar emits an object's properties in the schema's order.
        return msgspec.json.encode(value).decode()

    def cache_key(self, disable_any_whitespace: bool = False) -> tuple[str, str, bool]:
        """What identifies the compiled grammar: (kind, spec, compact JSON).

        Args:
            disable_any_whitespace: the engine's default (--structured-outputs-config).
        """
        return self.kind, self.spec, self.disable_any_whitespace or disable_any_whitespace
