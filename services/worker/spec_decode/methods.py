"""The built-in speculative methods behind the `Proposer` interface (proposer.py): the runner's
glue around ngram.py, draft_model.py, eagle_proposer.py (EAGLE-1, EAGLE-3, and MTP's layer
from mtp.py) and medusa.py."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from kvserve.services.worker.input_batch import InputBatch
from kvserve.services.worker.spec_decode.proposer import (
    Proposer,
    ProposerContext,
    proposal_requests,
)
from kvserve.services.worker.step_inputs import StepBatch

if TYPE_CHECKING:
    from kvserve.services.worker.spec_decode.eagle_proposer import DraftHead


class NgramMethod(Proposer):
    """Prompt lookup over each request's own tokens; the driver alone guesses."""

    def __init__(self, ctx: ProposerContext):
        from kvserve.services.worker.spec_decode.ngram import NgramProposer

        self.ctx = ctx
        self.ngram = NgramProposer(*ctx.config.ngram_range)

    def propose(self, step: StepBatch, batch: InputBatch) -> dict[str, list[int]]:
        asked = proposal_requests(step, batch, self.ctx.max_model_len)
        if asked is None or not self.ctx.is_driver:
            return {}
        proposals = self.ngram.propose(
            [batch.token_ids[r, :n] for r, n in zip(asked.rows, asked.num_tokens)],
            asked.num_drafts.tolist(),
        )
        return {s.req_id: p for s, p in zip(asked.states, proposals) if p}


class DraftModelMethod(Proposer):
    """A smaller model (or the target's first layers) guesses greedily, on every TP rank."""

    def __init__(self, ctx: ProposerContext):
        from kvserve.services.worker.spec_decode.draft_model import DraftModelProposer

        self.ctx = ctx
        self.draft = DraftModelProposer(
            ctx.config, ctx.target_model, ctx.dtype, ctx.device, ctx.block_size
        )

    def kv_cache_bytes_per_block(self) -> int:
        return self.draft.kv_cache_bytes_per_block()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.draft.initialize_kv_cache(num_blocks)

    def after_forward(self, step: StepBatch) -> None:
        self.draft.catch_up(step.input_ids, step.positions, step.metadata)

    def propose(self, step: StepBatch, batch: InputBatch) -> dict[str, list[int]]:
        asked = proposal_requests(step, batch, self.ctx.max_model_len)
        if asked is None:
            return {}
        rows, num_tokens = asked.rows, asked.num_tokens
        # Never past the slots the request holds for the draft's own steps.
        slots = batch.num_blocks[rows] * self.ctx.block_size
        num = np.maximum(np.minimum(asked.num_drafts, slots - (num_tokens - 1)), 0)
        lora = self.ctx.lora_manager
        proposals = self.draft.propose(
            batch.token_ids[rows, num_tokens - 1],
            num_tokens,
            batch.block_table[rows],
            num,
            None if lora is None else (lambda active: lora.prepare_step(rows[active])),
        )
        return {s.req_id: p for s, p in zip(asked.states, proposals) if p}


class EagleMethod(Proposer):
    """The EAGLE head (EAGLE-1, or EAGLE-3 with method eagle3) catches up on every verified
    position of each step, then guesses for the requests asked for drafts (every rank runs
    it)."""

    def __init__(self, ctx: ProposerContext):
        from kvserve.services.worker.spec_decode.eagle_proposer import EagleProposer

        self.ctx = ctx
        self.eagle = EagleProposer(
            self.load_head(ctx), ctx.config.method, ctx.dtype, ctx.device, ctx.block_size
        )

    def load_head(self, ctx: ProposerContext) -> DraftHead:
        """The draft head the proposer runs: the one in config.model's folder."""
        from kvserve.services.worker.spec_decode.eagle_proposer import load_draft_head

        return load_draft_head(ctx.config, ctx.target_model, ctx.dtype, ctx.device)

    def kv_cache_bytes_per_block(self) -> int:
        return self.eagle.kv_cache_bytes_per_block()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.eagle.initialize_kv_cache(num_blocks)

    def propose(self, step: StepBatch, batch: InputBatch) -> dict[str, list[int]]:
        assert step.hidden is not None, "EAGLE runs on a single stage"
        emitted = np.fromiter((len(t) for t in step.sampled), np.int64, len(step.sampled))
        # A request that sampled verified its last token's position and its accepted drafts
        # (emitted - 1); a prompt chunk, all of its positions.
        num_verified = np.where(
            emitted > 0, step.num_scheduled - step.num_drafts - 1 + emitted, step.num_scheduled
        )
        offsets = np.arange(int(num_verified.sum())) - np.repeat(
            np.cumsum(num_verified) - num_verified, num_verified
        )
        hidden_rows = np.repeat(step.query_start_loc[:-1].astype(np.int64), num_verified) + offsets
        wanted = step.so.spec_decode.num_to_propose
        num_wanted = np.fromiter(
            (wanted.get(s.req_id, 0) if n else 0 for s, n in zip(step.states, emitted)),
            np.int64,
            len(step.states),
        )
        num_wanted = np.minimum(num_wanted, self.ctx.max_model_len - batch.num_tokens[step.rows])
        guesses = self.eagle.step(
            step.rows, batch.token_ids, batch.block_table, batch.num_blocks, step.num_computed,
            num_verified, hidden_rows, step.hidden, np.maximum(num_wanted, 0),
        )  # fmt: skip
        return {s.req_id: g for s, g in zip(step.states, guesses) if g}


class MtpMethod(EagleMethod):
    """The target checkpoint's own multi-token-prediction layer (DeepSeek-V3's) as the draft
    head, run by the EAGLE proposer (mtp.py)."""

    def load_head(self, ctx: ProposerContext) -> DraftHead:
        from kvserve.services.worker.spec_decode.mtp import load_mtp_head

        if ctx.model_dir is None:
            raise ValueError(f"{ctx.config.method} reads the target's checkpoint folder")
        return load_mtp_head(
            ctx.model_dir, ctx.target_model, ctx.dtype, ctx.device, ctx.quantization
        )


class MedusaMethod(Proposer):
    """Residual heads over the target's hidden state at each request's last emitted token."""

    def __init__(self, ctx: ProposerContext):
        from kvserve.services.worker.spec_decode.medusa import MedusaProposer

        spec = ctx.config
        if not ctx.single_stage:
            raise ValueError("medusa speculation does not run with pipeline parallelism")
        assert spec.model is not None, "SpeculativeConfig checks medusa has a model"
        self.ctx = ctx
        self.medusa = MedusaProposer.load(spec.model, ctx.target_model, ctx.dtype, ctx.device)
        if spec.num_speculative_tokens > self.medusa.num_heads:
            raise ValueError(
                f"num_speculative_tokens {spec.num_speculative_tokens} exceeds the "
                f"{self.medusa.num_heads} Medusa heads of {spec.model}"
            )

    def propose(self, step: StepBatch, batch: InputBatch) -> dict[str, list[int]]:
        asked = proposal_requests(step, batch, self.ctx.max_model_len)
        if asked is None:
            return {}
        assert step.hidden is not None and step.last_rows is not None
        rows_t = torch.from_numpy(step.last_rows[asked.idx]).to(self.ctx.device)
        num = asked.num_drafts
        guesses = self.medusa.propose(step.hidden[rows_t], int(num.max())).cpu().tolist()
        proposals = [g[:n] for g, n in zip(guesses, num.tolist())]
        return {s.req_id: p for s, p in zip(asked.states, proposals) if p}
