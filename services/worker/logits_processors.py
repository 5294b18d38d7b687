"""What constrains a step's logits before sampling, batched over the rows that need it.

- the grammar bitmask of structured outputs (SchedulerOutput.grammar_bitmask): each row's
  forbidden tokens are set to -inf, from one unpacking of the packed bits;
- allowed_token_ids: every other token is set to -inf;
- bad_words: the last token of a bad word is set to -inf where the output ends with the
  word's other tokens;
- logit_bias: a bias added to listed tokens.

Per request the token ids are turned into numpy arrays once (`LogitsProcessorState`, kept on
the worker's RequestState); per step the rows that use a processor are gathered into flat
(row, token) index arrays and applied with one indexed write each, whatever the batch size.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvserve.shared.sampling_params import SamplingParams

_BITS = 32  # tokens per bitmask word


def apply_token_bitmask(logits: torch.Tensor, bitmask: np.ndarray, rows: np.ndarray) -> None:
    """Set to -inf, in place, the logits of the tokens each bitmask row forbids.

    Args:
        logits: [R, V] float32.
        bitmask: [N, W] int32, W = ceil(V' / 32); bit j of word w allows token 32 * w + j.
            Tokens past V' (a bitmask narrower than the logits) are forbidden.
        rows: [N] the logits row of each bitmask row.
    """
    vocab_size = logits.shape[1]
    if logits.is_cpu:
        forbidden = forbidden_tokens_numpy(bitmask, vocab_size)
    else:
        words = torch.from_numpy(bitmask).to(logits.device, non_blocking=True)
        forbidden = forbidden_tokens_torch(words, vocab_size)
    if len(rows) == logits.shape[0] and (rows == np.arange(len(rows))).all():
        logits.masked_fill_(forbidden, float("-inf"))
        return
    index = torch.from_numpy(rows).to(logits.device)
    logits[index] = logits[index].masked_fill_(forbidden, float("-inf"))


def forbidden_tokens_numpy(bitmask: np.ndarray, vocab_size: int) -> torch.Tensor:
    """[N, vocab_size] bool, True where the bitmask forbids the token (numpy's unpackbits:
    on CPU about 10x faster than shifting bits in torch)."""
    num_bits = min(vocab_size, bitmask.shape[1] * _BITS)
    # Little-endian words: byte k of word w holds the bits of tokens 32w + 8k .. + 7.
    packed = np.ascontiguousarray(~bitmask).view(np.uint8)
    forbidden = np.ones((len(bitmask), vocab_size), dtype=np.bool_)
    forbidden[:, :num_bits] = np.unpackbits(packed, axis=1, count=num_bits, bitorder="little").view(
        np.bool_
    )
    return torch.from_numpy(forbidden)


def forbidden_tokens_torch(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The same from an int32 tensor on any device (the GPU path): one shift per bit."""
    num_bits = min(vocab_size, words.shape[1] * _BITS)
    shifts = torch.arange(_BITS, dtype=torch.int32, device=words.device)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :num_bits]
    forbidden = torch.ones(len(words), vocab_size, dtype=torch.bool, device=words.device)
    forbidden[:, :num_bits] = ~allowed
    return forbidden


@dataclass(slots=True)
class LogitsProcessorState:
    """One request's logit_bias, allowed_token_ids and bad words as arrays, built once.

    Token ids at or past the vocabulary are dropped (the api refuses them; a request that
    slips through must not crash the worker).
    """

    bias_token_ids: np.ndarray | None = None  # int64
    bias_values: np.ndarray | None = None  # float32
    allowed_token_ids: np.ndarray | None = None  # int64
    bad_words_token_ids: list[list[int]] | None = None

    @classmethod
    def of(cls, params: SamplingParams, vocab_size: int) -> LogitsProcessorState | None:
        if not params.has_logits_processors:
            return None
        state = cls()
        if params.logit_bias:
            ids = np.fromiter(params.logit_bias, dtype=np.int64, count=len(params.logit_bias))
            values = np.fromiter(params.logit_bias.values(), dtype=np.float32, count=len(ids))
            keep = ids < vocab_size
            state.bias_token_ids, state.bias_values = ids[keep], values[keep]
        if params.allowed_token_ids:
            ids = np.asarray(params.allowed_token_ids, dtype=np.int64)
            state.allowed_token_ids = ids[ids < vocab_size]
        if params.bad_words_token_ids:
            state.bad_words_token_ids = [
                seq for seq in params.bad_words_token_ids if seq and max(seq) < vocab_size
            ]
        return state

    def banned_token_ids(self, output_token_ids: list[int]) -> list[int]:
        """The last token of each bad word whose other tokens end the output."""
        banned = []
        for seq in self.bad_words_token_ids or ():
            prefix_len = len(seq) - 1
            if prefix_len == 0 or (
                prefix_len <= len(output_token_ids)
                and output_token_ids[len(output_token_ids) - prefix_len :] == seq[:-1]
            ):
                banned.append(seq[-1])
        return banned


@dataclass(slots=True)
class LogitsProcessorBatch:
    """One step's processor inputs as flat index arrays (rows are logits rows).

    Args:
        allowed_rows: [A] rows with allowed_token_ids; allowed_index / allowed_token_ids:
            pairs (index into allowed_rows, token id) of the tokens they keep.
        banned_rows, banned_token_ids: pairs (row, token) set to -inf (bad words).
        bias_rows, bias_token_ids, bias_values: pairs (row, token) and the bias added.
    """

    allowed_rows: np.ndarray
    allowed_index: np.ndarray
    allowed_token_ids: np.ndarray
    banned_rows: np.ndarray
    banned_token_ids: np.ndarray
    bias_rows: np.ndarray
    bias_token_ids: np.ndarray
    bias_values: np.ndarray

    @classmethod
    def gather(
        cls, states: list[tuple[int, LogitsProcessorState, list[int]]]
    ) -> LogitsProcessorBatch:
        """Args: states: (logits row, the request's state, its output token ids) per row
        that has processors."""
        allowed_rows: list[int] = []
        allowed_index, allowed_ids = [], []
        banned_rows, banned_ids = [], []
        bias_rows, bias_ids, bias_values = [], [], []
        for row, state, output_token_ids in states:
            if state.allowed_token_ids is not None:
                allowed_index.append(np.full(len(state.allowed_token_ids), len(allowed_rows)))
                allowed_ids.append(state.allowed_token_ids)
                allowed_rows.append(row)
            if state.bad_words_token_ids:
                banned = state.banned_token_ids(output_token_ids)
                banned_rows.extend([row] * len(banned))
                banned_ids.extend(banned)
            if state.bias_token_ids is not None:
                assert state.bias_values is not None  # set together with bias_token_ids
                bias_rows.append(np.full(len(state.bias_token_ids), row))
                bias_ids.append(state.bias_token_ids)
                bias_values.append(state.bias_values)
        return cls(
            allowed_rows=np.asarray(allowed_rows, dtype=np.int64),
            allowed_index=_concat(allowed_index, np.int64),
            allowed_token_ids=_concat(allowed_ids, np.int64),
            banned_rows=np.asarray(banned_rows, dtype=np.int64),
            banned_token_ids=np.asarray(banned_ids, dtype=np.int64),
            bias_rows=_concat(bias_rows, np.int64),
            bias_token_ids=_concat(bias_ids, np.int64),
            bias_values=_concat(bias_values, np.float32),
        )

    def apply(self, logits: torch.Tensor) -> None:
        """allowed_token_ids, then bad words, then logit_bias, in place."""
        dev = logits.device
        if len(self.allowed_rows):
            rows = torch.from_numpy(self.allowed_rows).to(dev)
            keep = torch.zeros(
                len(self.allowed_rows), logits.shape[1], dtype=torch.bool, device=dev
            )
            keep[
                torch.from_numpy(self.allowed_index).to(dev),
                torch.from_numpy(self.allowed_token_ids).to(dev),
            ] = True
            logits[rows] = logits[rows].masked_fill_(~keep, float("-inf"))
        if len(self.banned_rows):
            logits[
                torch.from_numpy(self.banned_rows).to(dev),
                torch.from_numpy(self.banned_token_ids).to(dev),
            ] = float("-inf")
        if len(self.bias_rows):
            logits.index_put_(
                (
                    torch.from_numpy(self.bias_rows).to(dev),
                    torch.from_numpy(self.bias_token_ids).to(dev),
                ),
                torch.from_numpy(self.bias_values).to(dev),
                accumulate=True,
            )


def _concat(parts: list[np.ndarray], dtype) -> np.ndarray:
    return np.concatenate(parts).astype(dtype, copy=False) if parts else np.empty(0, dtype)
