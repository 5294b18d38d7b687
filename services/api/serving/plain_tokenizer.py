"""A tokenizer.json folder's tokenizer without transformers: the `tokenizers` library for the
ids, jinja2 for the chat template, both as transformers gives them.

Importing transformers costs the api process ~1.8 CPU seconds at every start, for a
tokenizer that, in the folders `load_plain_tokenizer` accepts, is tokenizer.json unchanged:
its tokenizer_config.json names a class that wraps tokenizer.json as it is
(`PreTrainedTokenizerFast`, or transformers 5's `TokenizersBackend`, which the GGUF
conversion writes), sets only special tokens and lengths, and every special token is one of
tokenizer.json's added tokens (transformers adds missing ones). Any other folder returns
None, and TokenizerInfo loads transformers' tokenizer as before. A `PlainTokenizer` asked
for anything it does not implement (a pair encoding, truncation, continue_final_message,
...) loads transformers' tokenizer once and answers from it.

The chat template renders as transformers' `apply_chat_template` renders it: the same
sandboxed environment and globals, messages without their None-valued keys, reasoning
copied under `reasoning_content` and `thinking`, the special tokens as variables
(tests/unit/api/serving/test_plain_tokenizer.py compares both on the default and the tiny
models).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from kvserve.shared.logging import init_logger

logger = init_logger(__name__)

# The classes that wrap tokenizer.json without changing it.
PLAIN_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")
SPECIAL_TOKEN_NAMES = (
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
)  # fmt: skip
# tokenizer_config.json keys that leave the tokenizer as tokenizer.json says; any other key
# (added_tokens_decoder, add_bos_token, clean_up_tokenization_spaces: true, ...) sends the
# folder to transformers.
_PLAIN_KEYS = {
    "tokenizer_class", "backend", "model_max_length", "is_local", "local_files_only",
    "name_or_path", "padding_side", "truncation_side", "model_input_names", "chat_template",
    "clean_up_tokenization_spaces", *SPECIAL_TOKEN_NAMES,
}  # fmt: skip
# transformers patches the pre-tokenizer of some vocabularies above this size (Mistral's).
_MAX_PLAIN_VOCAB = 100_000
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def load_plain_tokenizer(model_dir: str, chat_template: str | None) -> PlainTokenizer | None:
    """The folder's tokenizer without transformers, or None where transformers is needed.

    Args:
        model_dir: a folder with tokenizer.json and tokenizer_config.json.
        chat_template: a template that replaces the folder's own (--chat-template's text).
    """
    tokenizer_file = os.path.join(model_dir, "tokenizer.json")
    config_file = os.path.join(model_dir, "tokenizer_config.json")
    if not (os.path.isfile(tokenizer_file) and os.path.isfile(config_file)):
        return None
    with open(config_file, encoding="utf-8") as f:
        config = json.load(f)
    if config.get("tokenizer_class") not in PLAIN_CLASSES or not set(config) <= _PLAIN_KEYS:
        return None
    if config.get("clean_up_tokenization_spaces"):
        return None
    specials = {name: config[name] for name in SPECIAL_TOKEN_NAMES if config.get(name) is not None}
    if not all(isinstance(token, str) for token in specials.values()):
        return None
    backend = Tokenizer.from_file(tokenizer_file)
    added = {token.content for token in backend.get_added_tokens_decoder().values()}
    if not set(specials.values()) <= added or backend.get_vocab_size() > _MAX_PLAIN_VOCAB:
        return None
    if backend.truncation or backend.padding:
        return None
    template = chat_template if chat_template is not None else _folder_template(model_dir, config)
    if template is not None and not isinstance(template, str):
        return None  # named templates
    try:
        if template is not None:
            _compile(template)
    except jinja2.TemplateSyntaxError:
        return None  # e.g. transformers' {% generation %} tag
    return PlainTokenizer(model_dir, backend, specials, template, config)


def _folder_template(model_dir: str, config: dict) -> Any:
    path = os.path.join(model_dir, "chat_template.jinja")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    if os.path.exists(os.path.join(model_dir, "chat_template.json")) or os.path.isdir(
        os.path.join(model_dir, "additional_chat_templates")
    ):
        return []  # not a single template: transformers reads these
    return config.get("chat_template")


class PlainTokenizer:
    """transformers' fast tokenizer API over a `tokenizers.Tokenizer`, for what the api
    calls; other attributes come from transformers' tokenizer, loaded at first use.

    Args:
        model_dir: the tokenizer's folder.
        backend: its tokenizer.json.
        special_tokens: name (bos_token, ...) -> token text, as tokenizer_config.json sets.
        chat_template: the template, or None.
        config: tokenizer_config.json.
    """

    is_fast = True

    def __init__(
        self,
        model_dir: str,
        backend: Tokenizer,
        special_tokens: dict[str, str],
        chat_template: str | None,
        config: dict,
    ):
        self._transformers: Any = None
        self._tokenizer = backend
        self.model_dir = model_dir
        self.chat_template = chat_template
        self.special_tokens_map = dict(special_tokens)
        self.model_max_length = config.get("model_max_length", int(1e30))
        for name in SPECIAL_TOKEN_NAMES:
            token = special_tokens.get(name)
            setattr(self, name, token)
            setattr(self, f"{name}_id", None if token is None else backend.token_to_id(token))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.transformers_tokenizer(name), name)

    def __call__(self, *args, **kwargs) -> Any:
        return self.transformers_tokenizer("__call__")(*args, **kwargs)

    def __len__(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def transformers_tokenizer(self, wanted: str) -> Any:
        """transformers' own tokenizer of the folder (imported and loaded once).

        Args:
            wanted: what it is needed for (logged).
        """
        if self._transformers is None:
            from transformers import PreTrainedTokenizerFast

            logger.info("tokenizer of %s: loading transformers' for %s", self.model_dir, wanted)

            tokenizer = PreTrainedTokenizerFast.from_pretrained(self.model_dir)
            tokenizer.chat_template = self.chat_template
            self._transformers = tokenizer
        return self._transformers

    @property
    def all_special_tokens(self) -> list[str]:
        return list(dict.fromkeys(self.special_tokens_map.values()))

    @property
    def all_special_ids(self) -> list[int]:
        ids = (self._tokenizer.token_to_id(token) for token in self.all_special_tokens)
        return [token_id for token_id in ids if token_id is not None]

    def get_vocab(self) -> dict[str, int]:
        return self._tokenizer.get_vocab(with_added_tokens=True)

    def encode(self, text: Any, add_special_tokens: bool = True, **kwargs) -> list[int]:
        if kwargs or not isinstance(text, str):
            return self.transformers_tokenizer("encode").encode(text, add_special_tokens, **kwargs)
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Any, skip_special_tokens: bool = False, **kwargs) -> str:
        if kwargs:
            return self.transformers_tokenizer("decode").decode(
                token_ids, skip_special_tokens, **kwargs
            )
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Any, skip_special_tokens: bool = False) -> Any:
        if isinstance(ids, int):
            return self._tokenizer.id_to_token(ids)
        skipped = set(self.all_special_ids) if skip_special_tokens else set()
        return [self._tokenizer.id_to_token(int(i)) for i in ids if int(i) not in skipped]

    def convert_tokens_to_ids(self, tokens: Any) -> Any:
        if isinstance(tokens, str):
            token_id = self._tokenizer.token_to_id(tokens)
            return self.unk_token_id if token_id is None else token_id
        return [self.convert_tokens_to_ids(token) for token in tokens]

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        decoder = self._tokenizer.decoder
        return decoder.decode(tokens) if decoder is not None else " ".join(tokens)

    def apply_chat_template(
        self,
        conversation: list[dict],
        tools: list[Any] | None = None,
        documents: list[Any] | None = None,
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        **kwargs,
    ) -> Any:
        """The rendered conversation's ids (tokenize) or text, as transformers renders it;
        transformers' own for what this does not render (see `_own_kwargs`)."""
        if not _renders_alone(self.chat_template, conversation, tools, kwargs):
            return self.transformers_tokenizer("apply_chat_template").apply_chat_template(
                conversation, tools=tools, documents=documents,
                add_generation_prompt=add_generation_prompt, tokenize=tokenize, **kwargs,
            )  # fmt: skip
        if not conversation:
            raise ValueError("Cannot apply chat template to an empty conversation.")
        if documents is not None and not all(isinstance(d, dict) for d in documents):
            raise TypeError("Documents should be a list of dicts with 'title' and 'text' keys!")
        messages = _alias_reasoning(_plain([_without_none(m) for m in conversation]))
        text = _compile(self.chat_template).render(
            messages=messages,
            tools=_plain(tools),
            documents=_plain(documents),
            add_generation_prompt=add_generation_prompt,
            **_plain({**self.special_tokens_map, **kwargs}),
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text


# transformers' apply_chat_template arguments this module leaves to transformers.
_TRANSFORMERS_KWARGS = {
    "chat_template", "continue_final_message", "sanitize_control_tokens", "padding",
    "truncation", "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
    "tokenizer_kwargs",
}  # fmt: skip


def _renders_alone(template: Any, conversation: Any, tools: Any, kwargs: dict) -> bool:
    """Whether apply_chat_template renders here: a template, message dicts, tools as JSON
    schemas (not functions), no argument of _TRANSFORMERS_KWARGS."""
    return (
        isinstance(template, str)
        and isinstance(conversation, list)
        and all(isinstance(m, dict) for m in conversation)
        and all(isinstance(t, dict) for t in tools or ())
        and not _TRANSFORMERS_KWARGS & set(kwargs)
    )


def _without_none(message: dict) -> dict:
    # transformers drops None-valued keys: templates handle a missing key, not None.
    return {key: value for key, value in message.items() if value is not None}


def _alias_reasoning(messages: list[dict]) -> list[dict]:
    """A message's reasoning also as `thinking` and `reasoning_content` (transformers')."""
    aliased = []
    for message in messages:
        reasoning = next(
            (message[key] for key in _REASONING_FIELDS if message.get(key) is not None), None
        )
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        aliased.append(message)
    return aliased


def _plain(value: Any) -> Any:
    """The value as plain JSON types (transformers' `_plain_template_data`)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain(item) for item in value)
    return f"<{type(value).__name__}>"


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's own tojson escapes HTML characters; transformers' does not.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    """`dict` in a template, without the type's attributes."""

    def __call__(self, *args, **kwargs) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace` in a template, refusing underscore-prefixed names."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes on a namespace, "
                f"but got {name!r}."
            )


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    """The template in transformers' environment (chat templates are untrusted code)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(template)
