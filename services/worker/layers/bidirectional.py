"""Bidirectional attention for encoder models (BERT, XLM-RoBERTa, ModernBERT).

An encoder request is computed whole in one step (the engine turns chunked prefill and prefix
caching off for an encoder: engine/engine_core.py), so its keys are exactly the step's rows of
that request and nothing is read from or written to a KV cache. The step's flattened tokens
are padded into [num_reqs, max_len] (every layer reuses the indices and the padded buffers),
and torch's scaled_dot_product_attention runs over the padded batch with a key mask:

    tokens   a0 a1 a2 b0 b1          query_start_loc [0, 3, 5]
    padded   a0 a1 a2                key mask  1 1 1
             b0 b1 --                          1 1 0

The linear layers run on the flat [T, hidden] rows: only attention sees the padding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class EncoderBatch:
    """The step's requests as a padded batch: gather and scatter indices and key masks.

    Args:
        query_start_loc: [num_reqs + 1] offsets of each request's rows in the step.
    """

    def __init__(self, query_start_loc: torch.Tensor):
        starts = query_start_loc.to("cpu", torch.int64)
        lens = starts[1:] - starts[:-1]
        self.num_reqs = len(lens)
        self.max_len = int(lens.max()) if self.num_reqs else 0
        self.num_tokens = int(starts[-1])
        device = query_start_loc.device
        # Row r of request i sits at padded slot i * max_len + (r - start_i).
        req_of_token = torch.repeat_interleave(torch.arange(self.num_reqs), lens)
        offset = torch.arange(self.num_tokens) - starts[:-1][req_of_token]
        self.slots = (req_of_token * self.max_len + offset).to(device)
        self.all_equal = bool((lens == self.max_len).all())
        valid = torch.arange(self.max_len)[None, :] < lens[:, None]  # [B, L]
        self.key_mask = valid[:, None, None, :].to(device)  # [B, 1, 1, L]
        self._window_masks: dict[int, torch.Tensor] = {}
        # Padded buffers, zeroed once per forward and reused by every layer: only the
        # requests' slots are ever written, so the padding stays zero (a new zeroed buffer
        # per call cost as much as the copy into it: bench/RESULTS.md, issue 50).
        self._buffers: dict[tuple, torch.Tensor] = {}

    def pad(self, rows: torch.Tensor, buffer: int = 0) -> torch.Tensor:
        """[T, ...] -> [B, L, ...] (zeros where a request is shorter than the longest).

        Args:
            rows: the step's rows.
            buffer: which of this batch's padded buffers to fill: a result stays valid until
                the next pad into the same buffer (q, k and v of a layer take 0, 1 and 2).
        """
        if self.all_equal:
            return rows.view(self.num_reqs, self.max_len, *rows.shape[1:])
        key = (buffer, rows.shape[1:], rows.dtype, rows.device)
        padded = self._buffers.get(key)
        if padded is None:
            padded = rows.new_zeros(self.num_reqs * self.max_len, *rows.shape[1:])
            self._buffers[key] = padded
        padded[self.slots] = rows
        return padded.view(self.num_reqs, self.max_len, *rows.shape[1:])

    def unpad(self, padded: torch.Tensor) -> torch.Tensor:
        """[B, L, ...] -> [T, ...]: the inverse of pad."""
        flat = padded.reshape(self.num_reqs * self.max_len, *padded.shape[2:])
        return flat if self.all_equal else flat[self.slots]

    def mask(self, window: int | None) -> torch.Tensor | None:
        """The boolean mask (True: attend) of full attention, or of a local window where a
        token sees keys at most `window` positions away on either side; None when every
        request is as long as the longest and no window applies (no mask at all)."""
        if window is None:
            return None if self.all_equal else self.key_mask
        if window not in self._window_masks:
            pos = torch.arange(self.max_len, device=self.key_mask.device)
            band = (pos[:, None] - pos[None, :]).abs() <= window  # [L, L]
            self._window_masks[window] = self.key_mask & band[None, None]
        return self._window_masks[window]


def bidirectional_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    batch: EncoderBatch,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Attention of every token to every token of its own request (no causal mask).

    Args:
        q, k, v: [T, num_heads, head_dim] (an encoder has as many K/V heads as query heads).
        batch: the step's padding (EncoderBatch).
        scale: the softmax scale (1 / sqrt(head_dim) for every family here).
        window: a local layer's reach on either side (ModernBERT), None for full attention.

    Returns:
        [T, num_heads * head_dim].
    """
    qp, kp, vp = (batch.pad(x, i).transpose(1, 2) for i, x in enumerate((q, k, v)))  # [B,H,L,D]
    out = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=batch.mask(window), scale=scale)
    return batch.unpad(out.transpose(1, 2)).reshape(batch.num_tokens, -1)
