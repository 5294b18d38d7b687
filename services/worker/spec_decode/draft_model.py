"""Draft-model proposer: a smaller model with the target's vocabulary guesses k tokens,
one greedy token per forward, in its own paged KV cache.

Two forms:

- A separate draft (`model` set): its own weights and its own KV cache, with the target's
  block ids (the same blocks, one more tensor per draft layer). Each step it first runs the
  target's own flattened input (`catch_up`), so its cache holds every position the target's
  does, prefix-cache hits included; then it guesses.
- A self-draft (`model` unset): the target's first `num_draft_layers` layers, its final norm
  and LM head. Those layers' K/V are exactly the target's, so the draft shares the target's
  weights and KV cache: no memory, no catch-up. Its guesses write K/V past the verified
  tokens into the target's cache; the next step's verification overwrites those slots.

Guessing: the request's last token (the one just sampled, not yet in any cache) at position
num_tokens - 1, then each guess at the next position, k forwards of one token per request.
The scheduler reserved k lookahead slots for these writes (SpeculativeConfig
.uses_lookahead_slots). Drafts are greedy, so the rejection sampler treats them as
deterministic (q one-hot), which keeps random sampling exact.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import numpy as np
import torch

from kvserve.services.worker.layers.attention import (
    Attention,
    AttentionMetadata,
    bind_kv_caches,
    kv_cache_bytes_per_block,
)
from kvserve.services.worker.parallel_state import broadcast_from_driver, get_pp_size
from kvserve.services.worker.spec_decode.draft_head import DraftLMHead
from kvserve.shared.config import SpeculativeConfig
from kvserve.shared.logging import init_logger

if TYPE_CHECKING:
    from kvserve.services.worker.models.llama import LlamaForCausalLM

logger = init_logger(__name__)


class DraftModelProposer:
    """
    Args:
        config: the speculative config (method draft_model).
        target_model: the target; the self-draft runs its first layers.
        dtype, device: the target's.
        block_size: the KV cache's block size.
    """

    def __init__(
        self,
        config: SpeculativeConfig,
        target_model: torch.nn.Module,
        dtype: torch.dtype,
        device: torch.device,
        block_size: int,
    ):
        if get_pp_size() > 1:
            raise ValueError("draft_model speculation does not run with pipeline parallelism")
        self.device = device
        self.block_size = block_size
        self.owns_cache = config.model is not None
        # Every target is a LlamaForCausalLM (or a subclass); the seam types it nn.Module.
        target = cast("LlamaForCausalLM", target_model)
        if config.model is None:
            self.model = target
        else:
            from kvserve.services.worker.model_loader import resolve_model
            from kvserve.services.worker.models import load_model

            self.model, draft_config = load_model(
                resolve_model(config.model), dtype, device, None, config.model
            )
            target_vocab = target.config.vocab_size
            if draft_config.vocab_size != target_vocab:
                raise ValueError(
                    f"the draft model's vocabulary ({draft_config.vocab_size}) differs from "
                    f"the target's ({target_vocab})"
                )
        num_layers = self.model.config.num_hidden_layers
        self.num_layers = min(config.num_draft_layers or num_layers, num_layers)
        decoder_layers = self.model.model.layers[: self.num_layers]
        # The draft's own attention layers (empty for a self-draft: it uses the target's).
        self.attention_layers: list[Attention] = (
            [m for layer in decoder_layers for m in layer.modules() if isinstance(m, Attention)]
            if self.owns_cache
            else []
        )
        self.dtype = dtype
        self.lm_head = DraftLMHead(self.model)
        logger.info(
            "draft model: %s, %d layers, %s KV cache",
            config.model or "the target's first layers",
            self.num_layers,
            "its own" if self.owns_cache else "the target's",
        )

    # ------------------------------------------------------------------ KV cache

    def kv_cache_bytes_per_block(self) -> int:
        return kv_cache_bytes_per_block(self.attention_layers, self.block_size, self.dtype)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        bind_kv_caches(self.attention_layers, num_blocks, self.block_size, self.dtype, self.device)

    def _forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        return self.model.model(input_ids, positions, metadata, None, num_layers=self.num_layers)

    def catch_up(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> None:
        """Write the target step's K/V into the draft's own cache (a self-draft shares the
        target's and has nothing to do)."""
        if self.owns_cache:
            self._forward(input_ids, positions, metadata)

    def propose(
        self,
        last_token_ids: np.ndarray,
        num_tokens: np.ndarray,
        block_table: np.ndarray,
        num_drafts: np.ndarray,
        prepare_rows=None,
    ) -> list[list[int]]:
        """Greedy guesses, k forwards of one token per request (every TP rank runs them).

        Args:
            last_token_ids: [B] each request's last token (just sampled).
            num_tokens: [B] tokens each request holds, that one included.
            block_table: [B, W] each request's block ids (its lookahead slots included).
            num_drafts: [B] guesses wanted per request.
            prepare_rows: called with the batch rows of each forward (LoRA's per-token
                adapter indices), or None.
        """
        num_reqs = len(last_token_ids)
        out = np.zeros((num_reqs, int(num_drafts.max(initial=0))), dtype=np.int64)
        active = np.flatnonzero(num_drafts > 0)
        token_ids = last_token_ids.astype(np.int64)
        positions = num_tokens.astype(np.int64) - 1
        dev = self.device
        block_size = self.block_size
        for step in range(out.shape[1]):
            active = active[num_drafts[active] > step]
            if not len(active):
                break
            pos = positions[active] + step
            slot_mapping = (
                block_table[active, pos // block_size].astype(np.int64) * block_size
                + pos % block_size
            )
            seq_lens = (pos + 1).astype(np.int32)
            max_seq_len = int(seq_lens.max())
            num_blocks = -(-max_seq_len // block_size)
            metadata = AttentionMetadata(
                query_start_loc=torch.arange(len(active) + 1, dtype=torch.int32, device=dev),
                seq_lens=torch.from_numpy(seq_lens).to(dev),
                block_table=torch.from_numpy(
                    np.ascontiguousarray(block_table[active, :num_blocks])
                ).to(dev),
                slot_mapping=torch.from_numpy(slot_mapping).to(dev),
                max_query_len=1,
                max_seq_len=max_seq_len,
            )
            if prepare_rows is not None:
                prepare_rows(active)
            hidden = self._forward(
                torch.from_numpy(token_ids[active]).to(dev), torch.from_numpy(pos).to(dev), metadata
            )
            guesses = broadcast_from_driver(self.lm_head.argmax(hidden)).cpu().numpy()
            out[active, step] = guesses
            token_ids[active] = guesses
        return [out[i, : int(num_drafts[i])].tolist() for i in range(num_reqs)]
