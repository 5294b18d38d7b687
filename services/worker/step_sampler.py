"""The last part of a step: logits of the rows that sample, tokens sampled (or drafts verified)
on the driver, broadcast, and appended on every rank; and the prompt logprobs asked for.

Only the driver (TP rank 0 of the last stage) samples; every TP rank of the last stage computes
the logits (the LM head all-gathers), and every rank appends the broadcast tokens (next step's
inputs).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from kvserve.services.worker.input_batch import InputBatch
from kvserve.services.worker.parallel_state import broadcast_from_driver
from kvserve.services.worker.sampler import Sampler, compute_topk_logprobs
from kvserve.services.worker.sampling_inputs import (
    build_sampling_metadata,
    split_logprobs,
    to_logprobs,
)
from kvserve.services.worker.spec_decode.rejection_sampler import verify
from kvserve.services.worker.step_inputs import StepBatch
from kvserve.shared.messages import Logprobs

if TYPE_CHECKING:
    from kvserve.services.worker.models.llama import LlamaForCausalLM


class StepSampler:
    """Samples a step's tokens from its hidden states.

    Args:
        model: the model (its compute_logits).
        sampler: the sampler the driver runs.
        device: where the model runs.
        is_last_stage: this rank holds the last pipeline stage (the hidden states).
        is_driver: this rank samples.
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        sampler: Sampler,
        device: torch.device,
        is_last_stage: bool,
        is_driver: bool,
    ) -> None:
        self.model = model
        self.sampler = sampler
        self.device = device
        self.is_last_stage = is_last_stage
        self.is_driver = is_driver

    def sample(self, step: StepBatch, batch: InputBatch) -> None:
        """One token per sampling request; every rank appends it (next step's inputs)."""
        sample_idx = step.sample_idx
        states = [step.states[i] for i in sample_idx]
        sampled_ids = torch.empty(len(sample_idx), dtype=torch.int64, device=self.device)
        if self.is_last_stage:
            assert step.hidden is not None
            rows = torch.from_numpy(step.query_start_loc[1:][sample_idx] - 1).to(self.device)
            # Every TP rank of the stage takes part: the LM head all-gathers.
            logits = self.model.compute_logits(step.hidden[rows])
            if self.is_driver:
                md = build_sampling_metadata(batch, states, step.rows[sample_idx], step.so)
                out = self.sampler(logits, md)
                sampled_ids = out.sampled_token_ids
                if out.logprobs is not None:
                    step.logprobs = split_logprobs(states, out.logprobs)
        token_ids = broadcast_from_driver(sampled_ids).tolist()
        for i, state, token_id in zip(sample_idx, states, token_ids):
            batch.append_token(state, token_id)
            step.sampled[i] = [token_id]

    def verify_drafts(self, step: StepBatch, batch: InputBatch) -> None:
        """Score every draft position and keep what the rejection sampler accepts; fills
        step.sampled and step.logprobs, and step.last_rows with the hidden row of each
        request's last emitted token (what a Medusa proposer reads)."""
        sample_idx = step.sample_idx
        states = [step.states[i] for i in sample_idx]
        k = step.num_drafts[sample_idx]
        counts = k + 1
        ends = step.query_start_loc[1:][sample_idx]
        # Example: k = [2, 0], ends = [3, 7] -> logits rows [0 1 2 | 6]
        starts = ends - counts
        offsets = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
        logits_rows = np.repeat(starts, counts) + offsets
        emitted = torch.empty(
            len(sample_idx), int(k.max()) + 1, dtype=torch.int64, device=self.device
        )
        if self.is_last_stage:
            assert step.hidden is not None
            logits = self.model.compute_logits(
                step.hidden[torch.from_numpy(logits_rows).to(self.device)]
            )
            if self.is_driver:
                emitted = self._verify_on_driver(step, batch, logits, k)
        emitted_np = broadcast_from_driver(emitted).cpu().numpy()
        last_rows = step.query_start_loc[1:] - 1
        for j, (i, state) in enumerate(zip(sample_idx, states)):
            tokens = emitted_np[j][emitted_np[j] >= 0].tolist()
            for token_id in tokens:
                batch.append_token(state, token_id)
            step.sampled[i] = tokens
            last_rows[i] = starts[j] + len(tokens) - 1
        step.last_rows = last_rows

    def _verify_on_driver(
        self, step: StepBatch, batch: InputBatch, logits: torch.Tensor, k: np.ndarray
    ) -> torch.Tensor:
        """The driver's half of verify_drafts: sampling metadata with one row per logits
        row (a row sees the drafts before it as output), then the rejection sampler."""
        states = [step.states[i] for i in step.sample_idx]
        rows = step.rows[step.sample_idx]
        counts = k + 1
        spec = step.so.spec_decode.draft_token_ids
        drafts = [spec.get(s.req_id, []) for s in states]
        expanded_states = [s for s, n in zip(states, counts) for _ in range(n)]
        prefixes = [d[:j] for d, n in zip(drafts, counts) for j in range(n)]
        md = build_sampling_metadata(
            batch, expanded_states, np.repeat(rows, counts), step.so, prefixes
        )
        draft_ids = torch.tensor([t for d in drafts for t in d], dtype=torch.int64)
        is_greedy = torch.from_numpy(batch.temperature[rows] < 1e-5)
        generators = {i: s.generator for i, s in enumerate(states) if s.generator is not None}
        emitted, lp = verify(self.sampler, logits, md, draft_ids, k.tolist(), is_greedy, generators)
        if lp is not None:
            step.logprobs.update(_split_verified_logprobs(states, emitted, lp, counts))
        return emitted

    def prompt_logprobs(self, step: StepBatch, batch: InputBatch) -> dict[str, Logprobs]:
        """Logprobs of each prompt token given the ones before it, for requests that ask.

        The hidden state at position p predicts token p + 1, so a chunk covering positions
        [c, c + n) yields logprobs for prompt tokens c + 1 .. min(c + n, num_prompt - 1).
        """
        assert step.hidden is not None
        out = {}
        for i, s in enumerate(step.states):
            k = s.sampling_params.prompt_logprobs
            if k is None:
                continue
            start = int(step.num_computed[i])
            end = min(start + int(step.num_scheduled[i]), s.num_prompt_tokens - 1)
            if end <= start:
                continue
            q0 = int(step.query_start_loc[i])
            logits = self.model.compute_logits(step.hidden[q0 : q0 + end - start])  # TP collective
            if not self.is_driver:
                continue  # only the driver's answer reaches the engine core
            row = batch.token_ids[s.row]
            targets = torch.from_numpy(row[start + 1 : end + 1].copy()).to(logits.device)
            lp = torch.log_softmax(logits, dim=-1)
            out[s.req_id] = to_logprobs(compute_topk_logprobs(lp, targets, k))
        return out


def _split_verified_logprobs(states, emitted: torch.Tensor, lp, counts) -> dict[str, Logprobs]:
    """The emitted tokens' logprob rows of each request (its rows follow its drafts')."""
    out = {}
    start = 0
    for j, s in enumerate(states):
        n_lp = s.sampling_params.logprobs
        num_emitted = int((emitted[j] >= 0).sum())
        if n_lp is not None:
            sl = slice(start, start + num_emitted)
            out[s.req_id] = Logprobs(
                lp.token_ids[sl, : n_lp + 1].tolist(),
                lp.logprobs[sl, : n_lp + 1].tolist(),
                lp.ranks[sl].tolist(),
            )
        start += int(counts[j])
    return out
