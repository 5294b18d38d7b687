"""The xgrammar backend: a request's constraint compiled against the model's vocabulary, and
the matcher that walks it token by token.

Only the engine core imports this module (xgrammar imports torch): the api never does. The
StructuredOutputManager (structured_output.py) calls `XgrammarBackend.compile` on its thread
pool; the busy loop then owns one `Grammar` per request.

Every way a constraint can be wrong is a ValueError whose message names the problem: the
request then ends with an error, which the api answers as a 400.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import numpy as np
import xgrammar as xgr

from kvserve.services.scheduler.structured_output.json_schema_support import (
    schema_patterns,
    unsupported_features,
    with_length_patterns,
)
from kvserve.shared.model_dir import model_vocab_size as config_vocab_size
from kvserve.shared.structured_outputs import StructuredOutputsParams

# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: ".
_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")
# The characters xgrammar 0.2 allows in a string with minLength / maxLength, as it prints
# them: raw control characters pass (invalid JSON). The fix: JSON's own string characters
# (escapes stay out, as xgrammar has it).
_LENGTH_BOUNDED_CHARS = r"[^\"\\\r\n]"
_JSON_STRING_CHARS = r"[^\0-\x1f\"\\]"


def _backend_message(exc: Exception) -> str:
    lines = str(exc).strip().splitlines()
    return _CPP_PREFIX.sub("", lines[0] if lines else type(exc).__name__)


def model_vocab_size(model_dir: str, tokenizer_size: int) -> int:
    """The logits' width: config.json's vocab_size (also under text_config), which may pad
    the tokenizer's vocabulary; the tokenizer's size when the config names none."""
    size = config_vocab_size(model_dir)
    return tokenizer_size if size is None else max(size, tokenizer_size)


def load_tokenizer(tokenizer_dir: str):
    """The model's HF tokenizer (the fast class when tokenizer.json exists, as the api loads it)."""
    import transformers

    if os.path.exists(os.path.join(tokenizer_dir, "tokenizer.json")):
        return transformers.PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
    return transformers.AutoTokenizer.from_pretrained(tokenizer_dir)


def stop_token_ids(tokenizer, model_dir: str) -> list[int]:
    """EOS of the tokenizer and of generation_config.json: what ends a finished grammar."""
    ids = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    path = os.path.join(model_dir, "generation_config.json")
    if os.path.exists(path):
        with open(path) as f:
            eos = json.load(f).get("eos_token_id")
        ids += eos if isinstance(eos, list) else [] if eos is None else [eos]
    return sorted(set(ids))


class Grammar:
    """One request's position in its grammar.

    Args:
        matcher: an xgrammar GrammarMatcher of the request's compiled grammar.
    """

    def __init__(self, matcher: xgr.GrammarMatcher):
        self.matcher = matcher

    def accept_tokens(self, token_ids: list[int]) -> bool:
        """Advance over sampled tokens; False (the rest not taken) at one the grammar forbids."""
        return all(self.matcher.accept_token(token_id) for token_id in token_ids)

    def rollback(self, num_tokens: int) -> None:
        """Forget the last accepted tokens (rejected speculative tokens)."""
        self.matcher.rollback(num_tokens)

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted."""
        return self.matcher.is_terminated()


class XgrammarBackend:
    """The model's vocabulary as xgrammar sees it, and a compiler for it.

    Args:
        model_dir: the resolved model folder (config.json, generation_config.json).
        tokenizer_dir: where the tokenizer lives (--tokenizer, else model_dir).
        num_threads: threads one compilation may use.
    """

    def __init__(self, model_dir: str, tokenizer_dir: str, num_threads: int = 1):
        tokenizer = load_tokenizer(tokenizer_dir)
        self.vocab_size = model_vocab_size(model_dir, len(tokenizer))
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(
            tokenizer,
            vocab_size=self.vocab_size,
            stop_token_ids=stop_token_ids(tokenizer, model_dir) or None,
        )
        # The manager caches compiled grammars itself (by request key, with hit counts).
        self.compiler = xgr.GrammarCompiler(
            self.tokenizer_info, max_threads=num_threads, cache_enabled=False
        )
        self.batch_matcher = xgr.BatchGrammarMatcher(max_threads="auto")

    @property
    def bitmask_width(self) -> int:
        """int32 words per bitmask row."""
        return (self.vocab_size + 31) // 32

    def compile(self, params: StructuredOutputsParams, disable_any_whitespace: bool) -> Any:
        """The CompiledGrammar of one constraint.

        Args:
            params: the request's constraint.
            disable_any_whitespace: compact JSON (the request's or the engine's choice).

        Raises:
            ValueError: the constraint is malformed or uses what xgrammar cannot enforce.
        """
        kind = params.kind
        try:
            if kind == "json":
                return self._compile_json(checked_json_schema(params.json), disable_any_whitespace)
            if kind == "json_object":
                return self.compiler.compile_builtin_json_grammar()
            if kind == "regex":
                return self.compiler.compile_regex(params.spec)
            if kind == "choice":
                return self.compiler.compile_grammar(choice_grammar(params.choice or []))
            if kind == "grammar":
                return self.compiler.compile_grammar(params.spec)
            return self._compile_structural_tag(params.spec)
        except ValueError:
            raise
        except Exception as exc:  # noqa: BLE001 - xgrammar reports bad input as RuntimeError
            raise ValueError(f"invalid {_KIND_NAMES[kind]}: {_backend_message(exc)}") from None

    def _compile_json(self, schema: Any, disable_any_whitespace: bool) -> Any:
        """A schema's grammar, with JSON's string characters in its length-bounded strings.

        xgrammar's printed grammar is patched and compiled from text (its parser reads what
        its printer writes). Should that ever fail, the lengths become patterns instead
        (`with_length_patterns`): correct too, but about 100x slower to compile.
        """
        text = json.dumps(schema)
        grammar = xgr.Grammar.from_json_schema(text, any_whitespace=not disable_any_whitespace)
        ebnf = str(grammar)
        if _LENGTH_BOUNDED_CHARS not in ebnf:
            return self.compiler.compile_grammar(grammar)
        try:
            return self.compiler.compile_grammar(
                ebnf.replace(_LENGTH_BOUNDED_CHARS, _JSON_STRING_CHARS)
            )
        except Exception:  # noqa: BLE001 - the slower, equally exact path
            return self.compiler.compile_json_schema(
                json.dumps(with_length_patterns(schema)), any_whitespace=not disable_any_whitespace
            )

    def _compile_structural_tag(self, spec: str) -> Any:
        tag = json.loads(spec)
        if isinstance(tag, dict) and "structures" in tag:
            # vLLM's first format: begin / schema / end per structure, and trigger strings.
            items = [
                xgr.StructuralTagItem(
                    begin=s["begin"],
                    schema=json.dumps(with_length_patterns(checked_json_schema(s["schema"]))),
                    end=s["end"],
                )
                for s in tag["structures"]
            ]
            return self.compiler.compile_structural_tag(items, tag.get("triggers", []))
        return self.compiler.compile_structural_tag(spec)

    def make_grammar(self, compiled: Any) -> Grammar:
        return Grammar(xgr.GrammarMatcher(compiled))

    def fill_bitmask(self, grammars: list[Grammar], bitmask: np.ndarray) -> None:
        """Row i of bitmask = the tokens grammars[i] allows next, all rows in one call."""
        matchers = [g.matcher for g in grammars]
        self.batch_matcher.batch_fill_next_token_bitmask(matchers, bitmask)


_KIND_NAMES = {
    "json": "JSON schema",
    "json_object": "JSON object grammar",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
    "structural_tag": "structural tag",
}


def checked_json_schema(schema: Any) -> Any:
    """The schema as an object, once it is a valid JSON schema that xgrammar can enforce.

    Raises:
        ValueError: naming what is wrong and where.
    """
    import jsonschema

    if isinstance(schema, str):
        schema = json.loads(schema)
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path)
        raise ValueError(f"invalid JSON schema at #/{where}: {exc.message}") from None
    problems = unsupported_features(schema)
    for path, regex in schema_patterns(schema):
        try:
            xgr.Grammar.from_regex(regex)
        except Exception as exc:  # noqa: BLE001 - xgrammar's parse error, reported below
            problems.append(f"{path}: regex {regex!r} is not supported: {_backend_message(exc)}")
    if problems:
        raise ValueError("JSON schema not supported by xgrammar: " + "; ".join(problems))
    return schema


def choice_grammar(choices: list[str]) -> str:
    """EBNF matching exactly one of the strings. JSON's string escapes are EBNF's too; other
    characters stay as they are (xgrammar reads no surrogate pairs, as \\ud83d\\ude00)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
