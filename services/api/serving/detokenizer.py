"""Incremental detokenization: new token ids in, newly completed text out, one step at a time.

The api process holds no model, so this module must not import torch.

Byte-level BPE splits one character over several tokens (an emoji is often 2-4 tokens), and
SentencePiece tokens decode differently at the start of a string than in context. So a token
cannot be decoded alone. Two implementations share one interface (`update`, `output_text`);
`make_detokenizer` picks one:

- `FastIncrementalDetokenizer`, for fast tokenizers: `tokenizers.decoders.DecodeStream` (the
  Rust decoder's own streaming state) gets the last prompt tokens as context, then each new
  id; it returns text only once a character is complete. This is what vLLM does.
- `IncrementalDetokenizer`, the fallback for slow tokenizers (and a `tokenizers` without
  DecodeStream). Each step decodes a small window of tokens twice:

    tokens:  ...  [prefix_offset .. read_offset)  [read_offset .. len(tokens))
                   already emitted: context          new ids, not yet emitted
    prefix_text = text(tokens[prefix_offset:read_offset])
    new_text    = text(tokens[prefix_offset:])
    delta       = new_text[len(prefix_text):]

  and emits the delta only once it no longer ends in U+FFFD (a partial UTF-8 sequence), then
  slides the window forward.

Either way each step costs O(window), never O(output length), and the concatenated deltas
equal a one-shot decode of the output ids.
"""

from __future__ import annotations

from typing import Any

# Re-exported: callers take the detokenizer and the stop check from one place.
from kvserve.services.api.serving.stop_strings import check_stop_strings, num_held_back_chars
from kvserve.shared.logging import init_logger

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # tokenizers < 0.21
    DecodeStream = None  # type: ignore[misc, assignment]  # the optional-import idiom

__all__ = [
    "Detokenizer",
    "FastIncrementalDetokenizer",
    "IncrementalDetokenizer",
    "check_stop_strings",
    "make_detokenizer",
    "num_held_back_chars",
]

logger = init_logger(__name__)

# Prompt tokens that seed the window, so the first output token decodes in context.
_NUM_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"
# DecodeStream's context: the shortest prompt tail of at least this many tokens that
# decodes without a broken character, looked for up to the longer length.
_MIN_STREAM_CONTEXT_TOKENS = 4
_MAX_STREAM_CONTEXT_TOKENS = 24
# What `tokenizers` raises when a new id changes text the stream already returned.
_INVALID_PREFIX_ERROR = "Invalid prefix encountered"


def make_detokenizer(
    tokenizer: Any,
    prompt_token_ids: list[int],
    skip_special_tokens: bool,
    spaces_between_special_tokens: bool = True,
) -> Detokenizer:
    """The streaming detokenizer for one request: DecodeStream for a fast tokenizer, the
    windowed decode otherwise (see the module docstring; the arguments are theirs)."""
    if (
        DecodeStream is not None
        and getattr(tokenizer, "is_fast", False)
        and getattr(tokenizer, "_tokenizer", None) is not None
    ):
        return FastIncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens)
    return IncrementalDetokenizer(
        tokenizer, prompt_token_ids, skip_special_tokens, spaces_between_special_tokens
    )


class FastIncrementalDetokenizer:
    """Turns one request's output token ids into text with the fast tokenizer's DecodeStream.

    Args:
        tokenizer: a transformers fast tokenizer (its `_tokenizer` is the `tokenizers` one).
        prompt_token_ids: the request's prompt; its tail is decoding context only and never
            appears in the output text.
        skip_special_tokens: drop special tokens (EOS, chat markers) from the text.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool):
        self._backend = tokenizer._tokenizer
        self.skip_special_tokens = skip_special_tokens
        # Ids past the tokenizer's vocabulary (models pad their embedding) have no text.
        self._vocab_size = self._backend.get_vocab_size(with_added_tokens=True)
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        for token_id in self._prompt_context(prompt_token_ids):
            self._step(token_id)  # the prompt's text is context, never output
        self._output_text = ""

    @property
    def output_text(self) -> str:
        """All text emitted so far (held-back partial characters excluded)."""
        return self._output_text

    def update(self, new_token_ids: list[int]) -> str:
        """Adds the step's new token ids and returns the text they completed (maybe "").

        Args:
            new_token_ids: the ids generated since the last call, in order.
        """
        delta = "".join(piece for token_id in new_token_ids if (piece := self._step(token_id)))
        self._output_text += delta
        return delta

    def _prompt_context(self, prompt_token_ids: list[int]) -> list[int]:
        # A tail that starts inside a character would make the stream's first text garbage
        # and could swallow part of the first output character: start at a clean boundary.
        longest = min(len(prompt_token_ids), _MAX_STREAM_CONTEXT_TOKENS)
        for num_tokens in range(min(_MIN_STREAM_CONTEXT_TOKENS, longest), longest + 1):
            tail = prompt_token_ids[len(prompt_token_ids) - num_tokens :]
            if _REPLACEMENT_CHAR not in self._backend.decode(tail, skip_special_tokens=False):
                return tail
        return prompt_token_ids[len(prompt_token_ids) - longest :]

    def _step(self, token_id: int) -> str | None:
        if not 0 <= token_id < self._vocab_size:
            return None
        try:
            return self._stream.step(self._backend, token_id)
        except Exception as exc:
            if not str(exc).startswith(_INVALID_PREFIX_ERROR):
                raise
            # Rare: the decoder rewrote text it had returned already. Start a fresh stream
            # from this token (as vLLM does); the text so far stays as it was sent.
            logger.warning("detokenizer stream reset: %s", exc)
            self._stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)
            return self._stream.step(self._backend, token_id)


class IncrementalDetokenizer:
    """Turns one request's output token ids into text, step by step, with a sliding window
    of `convert_tokens_to_string` calls (slow tokenizers, or no DecodeStream).

    Args:
        tokenizer: a transformers tokenizer (anything with convert_ids_to_tokens,
            convert_tokens_to_string, is_fast, get_added_vocab, all_special_tokens).
        prompt_token_ids: the request's prompt; its tail is decoding context only and never
            appears in the output text.
        skip_special_tokens: drop special tokens (EOS, chat markers) from the text.
        spaces_between_special_tokens: join added tokens to their neighbours with spaces.
            As in transformers, only slow tokenizers honour it; fast ones decode added tokens
            inline whatever its value.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        skip_special_tokens: bool,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        # Only slow tokenizers need added tokens decoded apart from the rest.
        self._added_vocab: dict[str, int] = (
            {} if getattr(tokenizer, "is_fast", True) else tokenizer.get_added_vocab()
        )
        self._special_tokens = set(tokenizer.all_special_tokens) if self._added_vocab else set()
        # Two extra prompt tokens so that skipped special tokens still leave enough context.
        self.tokens = self._convert(prompt_token_ids[-(_NUM_PROMPT_CONTEXT_TOKENS + 2) :])
        self.read_offset = len(self.tokens)
        self.prefix_offset = max(self.read_offset - _NUM_PROMPT_CONTEXT_TOKENS, 0)
        self._prefix_text = self._to_string(self.tokens[self.prefix_offset : self.read_offset])
        self._output_text = ""

    @property
    def output_text(self) -> str:
        """All text emitted so far (held-back partial characters excluded)."""
        return self._output_text

    def update(self, new_token_ids: list[int]) -> str:
        """Adds the step's new token ids and returns the text they completed (maybe "").

        Args:
            new_token_ids: the ids generated since the last call, in order.
        """
        self.tokens.extend(self._convert(new_token_ids))
        new_text = self._to_string(self.tokens[self.prefix_offset :])
        if len(new_text) <= len(self._prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
            # A character is still incomplete (or the tokens added no text): hold it back
            # and decode it again, with the tokens that complete it, next step.
            return ""
        delta = new_text[len(self._prefix_text) :]
        # The emitted window becomes the next step's decoding context.
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.tokens)
        self._prefix_text = self._to_string(self.tokens[self.prefix_offset : self.read_offset])
        self._output_text += delta
        return delta

    def _convert(self, token_ids: list[int]) -> list[str]:
        tokens = self.tokenizer.convert_ids_to_tokens(
            token_ids, skip_special_tokens=self.skip_special_tokens
        )
        # Ids past the tokenizer's vocabulary (models pad their embedding) have no text.
        return [token for token in tokens if token is not None]

    def _to_string(self, tokens: list[str]) -> str:
        if not self._added_vocab:
            return self.tokenizer.convert_tokens_to_string(tokens)
        return self._to_string_with_added_tokens(tokens)

    def _to_string_with_added_tokens(self, tokens: list[str]) -> str:
        """Slow-tokenizer decoding: added tokens pass through verbatim, runs of ordinary
        tokens go through the tokenizer, and the pieces are joined (with spaces if asked)."""
        pieces: list[str] = []
        run: list[str] = []
        for token in tokens:
            if token not in self._added_vocab:
                run.append(token)
                continue
            if run:
                pieces.append(self.tokenizer.convert_tokens_to_string(run))
                run = []
            if not (self.skip_special_tokens and token in self._special_tokens):
                pieces.append(token)
        if run:
            pieces.append(self.tokenizer.convert_tokens_to_string(run))
        return (" " if self.spaces_between_special_tokens else "").join(pieces)


Detokenizer = FastIncrementalDetokenizer | IncrementalDetokenizer
