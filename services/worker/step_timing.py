"""Timed forward steps for the start-up measurements: the native decode stack's request limit
(CPU) and the step costs adaptive speculation weighs drafts against.

The steps are made up (timing_step): every request reads block 0 of the bound KV cache and
nothing is written, so they take the path real steps take without touching any request.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvserve.services.worker.layers.attention import Attention, AttentionMetadata
from kvserve.services.worker.layers.embed_head import ParallelLMHead
from kvserve.services.worker.layers.linear import LinearBase
from kvserve.services.worker.models.native_decode import bind_decode_stack, fit_stack_limit
from kvserve.shared.config import SchedulerConfig
from kvserve.shared.logging import init_logger

if TYPE_CHECKING:
    from kvserve.services.worker.models.llama import LlamaForCausalLM

logger = init_logger(__name__)
# The prompt chunks measure_prompt_costs times (a line through them sets the prior).
PROMPT_TIMING_TOKENS = (16, 64, 256)


class StepTimer:
    """Builds and times made-up steps through a runner's forward.

    Args:
        model: the model (its compute_logits, and for the CPU fit its native decode stack).
        run_stage: the runner's forward of this pipeline stage (ModelRunner._run_stage).
        dtype: the model's dtype.
        device: where the model runs.
        block_size: tokens per KV cache block.
        num_kv_cache_groups: how many block tables the layers read.
        is_last_stage: this rank holds the last pipeline stage (it computes the logits).
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        run_stage: Callable[..., torch.Tensor | None],
        dtype: torch.dtype,
        device: torch.device,
        block_size: int,
        num_kv_cache_groups: int,
        is_last_stage: bool,
    ) -> None:
        self.model = model
        self.run_stage = run_stage
        self.dtype = dtype
        self.device = device
        self.block_size = block_size
        self.num_kv_cache_groups = num_kv_cache_groups
        self.is_last_stage = is_last_stage

    def timing_step(
        self, query_lens: np.ndarray, context: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """(input ids, positions, metadata) of a step whose requests have these query lengths
        after `context` cached tokens each, for timing only: every request reads block 0 and
        nothing is written (the figures are times, not tokens)."""
        dev = self.device
        num_tokens = int(query_lens.sum())
        query_start_loc = np.zeros(len(query_lens) + 1, dtype=np.int32)
        np.cumsum(query_lens, out=query_start_loc[1:])
        positions = context + np.arange(num_tokens) - np.repeat(query_start_loc[:-1], query_lens)
        seq_lens = query_lens + context
        table_width = -(-int(seq_lens.max()) // self.block_size)
        metadata = AttentionMetadata(
            query_start_loc=torch.from_numpy(query_start_loc).to(dev),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(dev),
            block_table=torch.zeros(len(query_lens), table_width, dtype=torch.int32, device=dev),
            slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=dev),
            max_query_len=int(query_lens.max()),
            max_seq_len=int(seq_lens.max()),
        )
        # Every KV cache group reads the same block 0 and writes nothing.
        tables = (metadata.block_table, metadata.slot_mapping)
        metadata.group_tables = [tables] * (self.num_kv_cache_groups - 1)
        input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=dev)
        return input_ids, torch.from_numpy(positions).to(dev), metadata

    @torch.inference_mode()
    def fit_decode_stack(self, status: str, tokens_per_request: int) -> str:
        """Time decode steps of 1, 2, 4, ... requests (64 cached tokens each, logits included)
        on the bound native stack and on the modules, best of three interleaved rounds, and
        keep the stack to the request counts where it is not slower (fit_stack_limit): on a
        CPU with AMX, oneDNN's bfloat16 tiles beat the stack's GEMV from ~10 requests; without
        AMX the stack wins to 16 and beyond. Returns the start-up log's status."""
        inner = self.model.model
        stack = inner.decode_stack
        assert stack is not None, "fitted only once bound"
        head = getattr(self.model, "lm_head", None)
        head_rows = head.native_rows if isinstance(head, ParallelLMHead) else 0
        max_requests = stack.max_requests
        counts = [c for c in (1, 2, 4, 8, 16, 32, 64) if c < max_requests] + [max_requests]
        steps = [self.timing_step(np.ones(c, dtype=np.int32), context=64) for c in counts]

        def run(step, on_stack: bool) -> float:
            inner.decode_stack = stack if on_stack else None
            if isinstance(head, ParallelLMHead):
                head.native_rows = head_rows if on_stack else 0
            start = time.perf_counter()
            hidden = self.run_stage(*step)
            assert hidden is not None  # a single rank is its last stage
            self.model.compute_logits(hidden)
            return time.perf_counter() - start

        best = {True: [float("inf")] * len(counts), False: [float("inf")] * len(counts)}
        try:
            for _ in range(3):
                for i, step in enumerate(steps):
                    for on_stack in (True, False):
                        best[on_stack][i] = min(best[on_stack][i], run(step, on_stack))
        finally:
            inner.decode_stack = stack
            if isinstance(head, ParallelLMHead):
                head.native_rows = head_rows
        limit = fit_stack_limit(counts, best[True], best[False])
        timed = ", ".join(
            f"{c}: {s * 1e3:.1f} / {m * 1e3:.1f} ms"
            for c, s, m in zip(counts, best[True], best[False])
        )
        if limit == max_requests:
            return f"{status}; decode steps, stack / modules: {timed}"
        if limit == 0:
            bind_decode_stack(self.model, self.dtype, 0, tokens_per_request)
            return f"off: the modules were faster at every count (stack / modules: {timed})"
        status = bind_decode_stack(self.model, self.dtype, limit, tokens_per_request)
        return f"{status}; cut from {max_requests} requests (stack / modules: {timed})"

    @torch.inference_mode()
    def measure_step_costs(
        self, num_speculative_tokens: int, sched: SchedulerConfig
    ) -> list[tuple[int, float]]:
        """Seconds of a verifying step (logits for every token) of 1, 2, 4, ... query tokens:
        what the adaptive speculation rule weighs drafts against
        (services/scheduler/core/spec_decode.py). The tokens are split into requests of up to
        1 + k each, as a verify step carries them, and the step runs against the bound KV
        cache (writing nothing), so it takes the path real steps take: the native decode
        stack while it holds them, the modules after. Every rank runs it (collectives), the
        driver's figures are used.

        Args:
            num_speculative_tokens: k, the most drafts a request carries.
            sched: the scheduler limits (the largest step, the most requests).
        """
        limit = min(sched.max_num_batched_tokens, 4 * sched.max_num_seqs, 256)
        per_request = 1 + num_speculative_tokens
        steps = []
        num_tokens = 1
        while num_tokens <= limit:
            num_reqs = min(-(-num_tokens // per_request), sched.max_num_seqs)
            query_lens = np.full(num_reqs, num_tokens // num_reqs, dtype=np.int32)
            query_lens[: num_tokens % num_reqs] += 1
            steps.append(self.timing_step(query_lens))
            num_tokens *= 2
        costs = self._fastest(steps, rounds=3, every_logit=True)
        logger.info(
            "step costs for speculation: %s",
            ", ".join(f"{n} tokens {t * 1e3:.1f} ms" for n, t in costs),
        )
        return costs

    @torch.inference_mode()
    def measure_prompt_costs(self, sched: SchedulerConfig) -> list[tuple[int, float]]:
        """Seconds of a step computing one prompt chunk of PROMPT_TIMING_TOKENS (those up to
        max_num_batched_tokens; logits for its last token only): the prior of the step-time
        model the latency targets plan with (services/scheduler/core/step_time.py), so the
        first steps are sized from this machine's figures. Every rank runs it, the driver's
        figures are used."""
        sizes = [n for n in PROMPT_TIMING_TOKENS if n <= sched.max_num_batched_tokens]
        steps = [self.timing_step(np.array([n], dtype=np.int32)) for n in sizes]
        costs = self._fastest(steps, rounds=2, every_logit=False)
        logger.info(
            "prompt step costs for the latency targets: %s",
            ", ".join(f"{n} tokens {t * 1e3:.1f} ms" for n, t in costs),
        )
        return costs

    def _fastest(
        self,
        steps: list[tuple[torch.Tensor, torch.Tensor, AttentionMetadata]],
        rounds: int,
        every_logit: bool,
    ) -> list[tuple[int, float]]:
        """(tokens, seconds) of each step, the fastest of `rounds` rounds over every step (a
        burst of noise costs one round of one size, not a size's every try, which would bend
        the curve read off them); logits for every token, or for the last one."""
        best = [float("inf")] * len(steps)
        for _ in range(rounds):
            for i, (input_ids, positions_t, metadata) in enumerate(steps):
                start = time.perf_counter()
                hidden = self.run_stage(input_ids, positions_t, metadata)
                if self.is_last_stage:
                    assert hidden is not None  # the last stage returns its hidden states
                    self.model.compute_logits(hidden if every_logit else hidden[-1:])
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                best[i] = min(best[i], time.perf_counter() - start)
        return [(len(input_ids), t) for (input_ids, _, _), t in zip(steps, best)]


def prompt_keys_per_token(model: torch.nn.Module, attention_layers: list[Attention]) -> float:
    """How many attended keys cost what one prompt token's linear layers cost, by their
    arithmetic: a token multiplies by every linear layer's weight (2 x in x out FLOPs; the
    LM head only computes the requests' last tokens, so it is not counted), a query head
    of size d attending one key costs 4 x d (the score and the value); so keys per token =
    linear FLOPs / (4 x query heads x head size, over the attention layers). Both sides
    count this rank's share (its partitions' sizes: tensor parallelism divides both
    alike). 0 when the model has no attention layer or no linear layer (the step-time
    model then learns the context term alone). SmolLM2-135M: 212 MFLOP a token, 69 kFLOP
    a key: 3,072."""
    linear_flops = sum(
        2 * module.input_size * module.output_size
        for module in model.modules()
        if isinstance(module, LinearBase)
    )
    key_flops = sum(4 * layer.num_heads * layer.head_size for layer in attention_layers)
    if linear_flops <= 0 or key_flops <= 0:
        return 0.0
    return linear_flops / key_flops
