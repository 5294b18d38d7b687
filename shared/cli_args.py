"""Command-line flags generated from the typed option structs (shared/config.py,
shared/api_config.py, shared/launch_options.py).

Each field of a struct becomes one flag named after it (`max_num_seqs` -> `--max-num-seqs`),
its help text is the field's description, and its type, choices and required-ness follow the
annotation. A field whose type is itself a struct is a group of flags (EngineConfig's
ModelConfig, CacheConfig, ...), so one tree of structs describes a whole command:

    parser = argparse.ArgumentParser()
    add_struct_args(parser, ServeOptions, positional=("model",))
    options = struct_from_args(ServeOptions, parser.parse_args(argv))

Flags the user did not give stay absent from the namespace (argparse.SUPPRESS), so every
default lives in one place: the struct.

Field metadata (`msgspec.Meta(extra={...})`):
    aliases: extra flag spellings (vLLM's, e.g. ["--executor"]).
    parse: "size" takes byte sizes such as 4G; "tokens" token counts such as 32k; "json" the
        field's value as JSON (a struct, a list); "items" one or more values of a list
        field, each read by its item type's `parse_flag(text)` (--lora-modules a=/x b=/y).
"""

from __future__ import annotations

import argparse
import types
import typing
from collections.abc import Collection, Iterator
from typing import Any

import msgspec

_SIZE_SUFFIXES = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_POSITIONAL_DEST = "{}__positional"


def parse_tokens(text: str) -> int:
    """A token count as vLLM reads one: '32768', '32k' (x 1000) or '32K' (x 1024), '1.5m'."""
    t = text.strip()
    scale = {"k": 10**3, "m": 10**6, "g": 10**9, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if t and t[-1] in scale:
        return int(float(t[:-1]) * scale[t[-1]])
    return int(t)


def parse_size(text: str) -> int:
    """Bytes from '4294967296', '4G', '4GiB' or '512M'."""
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    if t and t[-1] in _SIZE_SUFFIXES:
        return int(float(t[:-1]) * _SIZE_SUFFIXES[t[-1]])
    return int(t)


def flag_doc(text: str, **extra: Any) -> msgspec.Meta:
    """A field's description (its --help text); `extra` holds flag details (see above)."""
    return msgspec.Meta(description=text, extra=extra or None)


class _Field(msgspec.Struct, frozen=True):
    name: str
    annotation: Any  # without the Annotated wrapper
    description: str
    extra: dict[str, Any]
    required: bool


def _is_struct(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, msgspec.Struct)


def _fields(struct_type: type[msgspec.Struct]) -> Iterator[_Field]:
    hints = typing.get_type_hints(struct_type, include_extras=True)
    for info in msgspec.structs.fields(struct_type):
        annotation, description, extra = hints[info.name], "", {}
        if typing.get_origin(annotation) is typing.Annotated:
            annotation, *metadata = typing.get_args(annotation)
            for meta in metadata:
                if isinstance(meta, msgspec.Meta):
                    description = meta.description or description
                    extra = dict(meta.extra or {})
        yield _Field(info.name, annotation, description, extra, info.required)


def _strip_optional(annotation: Any) -> Any:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _flag_kwargs(field: _Field) -> dict[str, Any]:
    """argparse kwargs for one field; bool flags get --x/--no-x."""
    annotation = _strip_optional(field.annotation)
    parse = field.extra.get("parse")
    if parse == "size":
        return {"type": parse_size, "metavar": "BYTES"}
    if parse == "tokens":
        return {"type": parse_tokens, "metavar": "TOKENS"}
    if parse == "json":
        return {"type": _json_parser(annotation), "metavar": "JSON"}
    if parse == "items":
        (item_type,) = typing.get_args(annotation)
        return {"type": _item_parser(item_type), "nargs": "+", "metavar": "ITEM"}
    if annotation is bool:
        return {"action": argparse.BooleanOptionalAction}
    if typing.get_origin(annotation) is typing.Literal:
        return {"choices": list(typing.get_args(annotation))}
    if annotation in (int, float, str):
        return {"type": annotation}
    if annotation == list[int]:  # vLLM's list flags: --cuda-graph-sizes 1 2 4
        return {"type": int, "nargs": "*", "metavar": "N"}
    raise TypeError(f"field {field.name!r}: no flag type for {field.annotation!r}")


def _json_parser(annotation: Any):
    """A flag type that decodes JSON into the field's type; errors say what is wrong."""

    def parse_json(text: str) -> Any:
        try:
            return msgspec.json.decode(text, type=annotation)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None

    return parse_json


def _item_parser(item_type: Any):
    """A flag type for one item of a list field: the item type's `parse_flag(text)`."""

    def parse_item(text: str) -> Any:
        try:
            return item_type.parse_flag(text)
        except (ValueError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse_item


def _is_group(field: _Field) -> bool:
    return _is_struct(field.annotation) and field.extra.get("parse") != "json"


def flag_names(struct_type: type[msgspec.Struct]) -> set[str]:
    """Every scalar field of the struct tree: the flags the tree makes."""
    names: set[str] = set()
    for field in _fields(struct_type):
        names |= flag_names(field.annotation) if _is_group(field) else {field.name}
    return names


def add_struct_args(
    parser: argparse.ArgumentParser,
    struct_type: type[msgspec.Struct],
    *,
    positional: Collection[str] = (),
    skip: Collection[str] = (),
) -> None:
    """One flag per scalar field of the struct tree, one argument group per nested struct.

    Args:
        positional: fields that may also be given as an optional positional argument (MODEL);
            `--name` works too.
        skip: fields to leave out of the parser (they keep their defaults).
    """
    _add_fields(parser, struct_type, positional, skip, set())


def _add_fields(
    parser: argparse.ArgumentParser,
    struct_type: type[msgspec.Struct],
    positional: Collection[str],
    skip: Collection[str],
    seen: set[str],
) -> None:
    # argparse groups do not nest: a struct's scalar fields form one group on the parser,
    # and its struct fields recurse with the parser itself.
    group = None
    for field in _fields(struct_type):
        if _is_group(field):
            _add_fields(parser, field.annotation, positional, skip, seen)
            continue
        if field.name in skip:
            continue
        # One flag per name in a whole tree: two structs must not own the same flag.
        assert field.name not in seen, f"flag --{field.name} defined twice"
        seen.add(field.name)
        if group is None:
            doc = (struct_type.__doc__ or "").strip().splitlines()
            group = parser.add_argument_group(struct_type.__name__, doc[0] if doc else None)
        if field.name in positional:
            group.add_argument(
                _POSITIONAL_DEST.format(field.name),
                nargs="?",
                metavar=field.name.upper(),
                default=argparse.SUPPRESS,
                help=field.description,
            )
        flags = ["--" + field.name.replace("_", "-"), *field.extra.get("aliases", [])]
        group.add_argument(
            *flags,
            dest=field.name,
            default=argparse.SUPPRESS,
            required=field.required and field.name not in positional,
            help=field.description,
            **_flag_kwargs(field),
        )


def struct_from_args(struct_type: type[msgspec.Struct], args: argparse.Namespace, **overrides):
    """The struct tree from parsed flags: given flags set fields, the rest keep defaults.

    Raises:
        ValueError: a field given both as positional and as --flag with different values, or
            a struct's own validation failed.
    """
    given = dict(vars(args))
    for name in list(given):
        if name.endswith("__positional"):
            field_name = name.removesuffix("__positional")
            value = given.pop(name)
            if field_name in given and given[field_name] != value:
                raise ValueError(
                    f"{field_name} given twice: {value!r} and "
                    f"--{field_name.replace('_', '-')} {given[field_name]!r}"
                )
            given[field_name] = value
    given.update(overrides)
    return _build(struct_type, given)


def _build(struct_type: type[msgspec.Struct], given: dict[str, Any]):
    kwargs = {}
    for field in _fields(struct_type):
        if _is_group(field):
            kwargs[field.name] = _build(field.annotation, given)
        elif field.name in given:
            kwargs[field.name] = given[field.name]
    return struct_type(**kwargs)


class RefusedFlag(msgspec.Struct, frozen=True):
    """A flag of vLLM's that kvserve knows but cannot honour.

    Args:
        reason: why, and what to do instead (the error says it).
        accepted: values that ask for nothing kvserve lacks (e.g. --kv-cache-dtype auto).
    """

    reason: str
    accepted: tuple[str, ...] = ()


def add_refused_flags(parser: argparse.ArgumentParser, refused: dict[str, RefusedFlag]) -> None:
    """Each flag parses (with or without a value) and is refused with its reason, unless its
    value is one it accepts: a vLLM flag is never silently ignored."""
    group = parser.add_argument_group("vLLM flags kvserve does not support")
    for flag, spec in refused.items():
        group.add_argument(
            flag,
            nargs="?",
            action=_RefuseAction,
            const=None,
            default=argparse.SUPPRESS,
            spec=spec,
            help=argparse.SUPPRESS,
        )


class _RefuseAction(argparse.Action):
    def __init__(self, *args: Any, spec: RefusedFlag, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.spec = spec

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        if values is not None and values in self.spec.accepted:
            return
        given = option_string if values is None else f"{option_string} {values}"
        parser.error(f"{given}: not supported by kvserve: {self.spec.reason}")
