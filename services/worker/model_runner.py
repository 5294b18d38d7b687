"""ModelRunner: turns a SchedulerOutput into one flattened forward pass and sampled tokens.

Under TP x PP every rank runs this same step on the same SchedulerOutput, so every rank
builds the same inputs. One step (synchronous pipeline: one step in flight):

    stage 0:       embed + its layers --send (hidden, residual)--> stage 1
    stage 1..:     recv --> its layers --send--> next stage
    last stage:    recv --> its layers --> norm --> logits (all-gathered over TP)
    driver rank:   sample --broadcast sampled ids--> every rank appends them

Only the driver (TP rank 0 of the last stage) samples: the others would do the same work for
the same result, and on a shared CPU that work is taken from the driver.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

from kvserve.kernels import cpu, cpu_prefill, gemm, prefill_route
from kvserve.services.kv_store.connector import WorkerConnector
from kvserve.services.worker.cuda_graphs import DecodeGraphs, capture_decode_graphs
from kvserve.services.worker.input_batch import InputBatch
from kvserve.services.worker.kv_cache_groups import (
    bind_grouped_kv_caches,
    group_kv_cache_bytes_per_block,
    plan_kv_cache_groups,
)
from kvserve.services.worker.kv_scales import check_layers_take, resolve_kv_cache_dtype
from kvserve.services.worker.layers.attention import (
    Attention,
    AttentionMetadata,
    bind_kv_caches,
    kv_cache_bytes_per_block,
)
from kvserve.services.worker.layers.embed_head import ParallelLMHead
from kvserve.services.worker.layers.linear import LinearBase
from kvserve.services.worker.model_loader import weights_identity
from kvserve.services.worker.models import load_model
from kvserve.services.worker.models.native_decode import bind_decode_stack, fit_stack_limit
from kvserve.services.worker.parallel_state import (
    broadcast_from_driver,
    get_tp_rank,
    get_tp_size,
    is_driver,
    is_first_pp_rank,
    is_last_pp_rank,
    recv_from_prev_stage,
    send_to_next_stage,
)
from kvserve.services.worker.sampler import Sampler, compute_topk_logprobs
from kvserve.services.worker.sampling_inputs import (
    build_sampling_metadata,
    split_logprobs,
    to_logprobs,
)
from kvserve.services.worker.spec_decode.proposer import Proposer, ProposerContext
from kvserve.services.worker.spec_decode.registry import make_proposer
from kvserve.services.worker.spec_decode.rejection_sampler import verify
from kvserve.services.worker.step_inputs import StepBatch, prepare_inputs
from kvserve.shared import env
from kvserve.shared.config import EngineConfig, SpeculativeConfig
from kvserve.shared.kv_cache_groups import group_size_of
from kvserve.shared.logging import init_logger
from kvserve.shared.messages import KvFingerprint, Logprobs, ModelRunnerOutput, SchedulerOutput

logger = init_logger(__name__)


class ModelRunner:
    """Holds the model, its paged KV cache and the per-request input batch.

    Args:
        config: the engine config.
        model_dir: a resolved HF-style model folder.
        device: where the model runs.
    """

    def __init__(self, config: EngineConfig, model_dir: str, device: torch.device):
        self.config = config
        self.device = device
        self.dtype = resolve_dtype(config.model.dtype_name, device, checkpoint_dtype(model_dir))
        self.model, self.hf_config = load_model(
            model_dir, self.dtype, device, config.model.quantization, config.model.model
        )
        self.model_identity = weights_identity(model_dir, config.model.quantization)
        self.vocab_size = self.hf_config.vocab_size
        self.hidden_size = self.hf_config.hidden_size
        self.is_first_stage = is_first_pp_rank()
        self.is_last_stage = is_last_pp_rank()
        self.is_driver = is_driver()
        self.max_model_len = effective_max_model_len(config, self.hf_config)
        self.block_size = config.cache.block_size
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        self.kv_cache_groups = plan_kv_cache_groups(
            config, self.attention_layers, self.is_first_stage and self.is_last_stage
        )
        # --kv-cache-dtype: the model's dtype, or fp8 with each layer's scales (kv_scales.py).
        self.kv_cache_dtype = resolve_kv_cache_dtype(config.cache.cache_dtype, self.dtype)
        check_layers_take(self.kv_cache_dtype, self.attention_layers)
        # LoRA wraps the linear layers before the GEMM plan, which finds them inside.
        self.lora_manager = None
        if config.lora.enable_lora:
            from kvserve.services.worker.lora.manager import LoRAManager

            self.lora_manager = LoRAManager(
                self.model, config.lora, config.scheduler.max_num_seqs, self.dtype, device
            )
        self.gemm_plan = self.prepare_gemm() if device.type == "cpu" else None
        self.sampler = Sampler()
        self.spec_config = config.speculative_config
        self.proposer: Proposer | None = None  # the speculative method's, when there is one
        if self.spec_config is not None:
            self.proposer = make_proposer(self._proposer_context(self.spec_config))
        self.input_batch: InputBatch | None = None
        self.kv_caches: list[torch.Tensor] = []
        self.kv_connector: WorkerConnector | None = None  # with --kv-transfer-config
        self.cuda_graphs: DecodeGraphs | None = None  # captured after the KV cache
        # The native decode stack's request limit the first KV cache's fit found (None: not
        # fitted), bound again without measuring when a wake_up binds a new cache.
        self._fitted_stack_rows: int | None = None
        self._kv_measured = False  # the CPU measurements that follow a bound cache ran
        # Images in the prompt: the vision encoder's runs and cache (worker/multimodal.py).
        self.multimodal = None
        if getattr(self.model, "supports_images", False):
            from kvserve.services.worker.multimodal import MultimodalRunner

            self.multimodal = MultimodalRunner(self.model, device)
        if config.kv_transfer_config is not None and not (
            self.is_first_stage and self.is_last_stage
        ):
            raise ValueError("KV transfer (--kv-transfer-config) does not run with PP > 1")

    # ------------------------------------------------------------------ GEMM paths

    def prepare_gemm(self) -> gemm.GemmPlan:
        """Measure (or reuse) the CPU GEMM plan of every linear layer and the LM head, and
        give each layer whose plan leaves torch its plan (and oneDNN's packed weight where
        the plan uses oneDNN)."""
        sched = self.config.scheduler
        layers = [
            (
                m,
                sched.max_num_seqs
                if isinstance(m, ParallelLMHead)
                else sched.max_num_batched_tokens,
            )
            for m in self.model.modules()
            if isinstance(m, LinearBase | ParallelLMHead)
            and m.weight.is_floating_point()  # weights held quantized have their own kernels
        ]
        plan = gemm.tune(
            ((m.weight.dtype, *m.weight.shape, max_rows) for m, max_rows in layers),
            mode=self.config.model.cpu_gemm,
        )
        packed: dict[int, torch.Tensor] = {}  # a tied LM head shares the embedding's pack
        for module, _ in layers:
            shape_plan = plan.for_weight(module.weight)
            if shape_plan is None or set(shape_plan.paths) == {"torch"}:
                continue
            key = module.weight.data_ptr()
            if key not in packed and "onednn" in shape_plan.paths:
                packed[key] = gemm.pack_onednn(module.weight)
            module.gemm = gemm.LinearWeights(shape_plan, packed.get(key))
        how = plan.source
        if plan.source == "measured":
            how = f"measured in {plan.seconds:.1f} s"
            if plan.stalled_share is not None:
                how += f", tasks waited for a CPU {100 * plan.stalled_share:.0f}% of it"
            if plan.unmeasured:
                how += f", {plan.unmeasured} shapes left on torch unmeasured"
        logger.info(
            "CPU GEMM plan (%s, %d threads, %s): %s",
            how,
            torch.get_num_threads(),
            cpu.cpu_isa(),
            ", ".join(f"{k} {v}" for k, v in plan.summary().items()),
        )
        return plan

    def _proposer_context(self, spec: SpeculativeConfig) -> ProposerContext:
        return ProposerContext(
            config=spec,
            target_model=self.model,
            dtype=self.dtype,
            device=self.device,
            block_size=self.block_size,
            max_model_len=self.max_model_len,
            is_driver=self.is_driver,
            single_stage=self.is_first_stage and self.is_last_stage,
            lora_manager=self.lora_manager,
        )

    # ------------------------------------------------------------------ KV cache

    def kv_fingerprint(self) -> KvFingerprint:
        """This rank's block layout, as the KV connector's store keys it."""
        spec = self.attention_layers[0].kv_cache_spec()
        return KvFingerprint(
            model=self.model_identity,  # not the served name: any node, any path
            dtype=str(self.kv_cache_dtype).removeprefix("torch."),
            block_size=self.block_size,
            # A block is a page of each cache tensor: every layer's, or with KV cache
            # groups one group's (each group's blocks keyed apart: its hash suffix).
            num_layers=group_size_of(self.kv_cache_groups),
            num_kv_heads=spec.num_kv_heads,
            head_size=spec.head_size,
            tp_rank=get_tp_rank(),
            num_planes=spec.num_planes,
        )

    def kv_cache_bytes_per_block(self) -> int:
        """Bytes of one block over every layer (a draft model's own layers too)."""
        target = kv_cache_bytes_per_block(
            self.attention_layers, self.block_size, self.kv_cache_dtype
        )
        if len(self.kv_cache_groups) > 1:  # a block is a page of one group's layers
            target = group_kv_cache_bytes_per_block(
                self.attention_layers, self.kv_cache_groups, self.block_size, self.kv_cache_dtype
            )
        return target + (self.proposer.kv_cache_bytes_per_block() if self.proposer else 0)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate each layer's cache (its KVCacheSpec: [2, num_blocks, block_size, Hkv, D]
        for full attention) and bind it to the layer."""
        bind = bind_kv_caches
        if len(self.kv_cache_groups) > 1:
            bind = functools.partial(bind_grouped_kv_caches, groups=self.kv_cache_groups)
        self.kv_caches = bind(
            self.attention_layers, num_blocks, self.block_size, self.kv_cache_dtype, self.device
        )
        if self.proposer is not None:
            self.proposer.initialize_kv_cache(num_blocks)
        if self.config.kv_transfer_config is not None:
            from kvserve.services.kv_store.registry import make_worker_connector

            self.kv_connector = make_worker_connector(
                self.config.kv_transfer_config, self.kv_fingerprint(), self.kv_caches
            )
        max_blocks_per_req = -(-self.max_model_len // self.block_size)
        self.input_batch = InputBatch(
            self.config.scheduler.max_num_seqs,
            self.max_model_len,
            max_blocks_per_req,
            self.vocab_size,
            len(self.kv_cache_groups),
        )
        logger.info(
            "KV cache: %d blocks of %d tokens, %.1f MiB, %s",
            num_blocks,
            self.block_size,
            num_blocks * self.kv_cache_bytes_per_block() / 2**20,
            str(self.kv_cache_dtype).removeprefix("torch."),
        )
        one_table = len(self.kv_cache_groups) == 1  # what the graphs and the C stack read
        self.cuda_graphs = self.capture_cuda_graphs(max_blocks_per_req) if one_table else None
        if self.device.type == "cpu":
            # A verify step of the same requests carries up to 1 + k tokens each: it runs the
            # stack too, so its tokens get what decode steps would give them.
            spec = self.spec_config
            tokens = 1 + (spec.num_speculative_tokens if spec is not None else 0)
            # A cache bound again (a wake_up) keeps what the first one measured.
            rows = self._fitted_stack_rows
            if rows is None:
                rows = env.NATIVE_DECODE_ROWS.get()
            status = bind_decode_stack(self.model, self.dtype, rows if one_table else 0, tokens)
            if not one_table:
                status = "off: the layers read several KV cache groups' block tables"
            stack = getattr(getattr(self.model, "model", None), "decode_stack", None)
            single_rank = self.is_first_stage and self.is_last_stage and get_tp_size() == 1
            measure = not self._kv_measured
            if stack is not None and single_rank and env.NATIVE_DECODE_MEASURE.get() and measure:
                status = self._fit_decode_stack(status, tokens)
                fitted = getattr(self.model.model, "decode_stack", None)
                self._fitted_stack_rows = fitted.max_requests if fitted is not None else 0
            logger.info("native decode stack %s", status)
            if cpu.available(self.dtype) and env.PREFILL_ROUTE_MEASURE.get() and measure:
                self._measure_prefill_route()
            self._kv_measured = True

    def free_kv_cache(self) -> None:
        """Sleep (services/worker/sleep.py): drop every reference to the KV cache (the
        layers', the CUDA graphs', the native decode stack's) so that its memory returns;
        initialize_kv_cache binds a new one."""
        self.cuda_graphs = None
        inner = getattr(self.model, "model", None)
        if inner is not None and getattr(inner, "decode_stack", None) is not None:
            inner.decode_stack = None
        head = getattr(self.model, "lm_head", None)
        if isinstance(head, ParallelLMHead):
            head.native_rows = 0
        for layer in self.attention_layers:
            layer.kv_cache = None
        self.kv_caches = []
        self.input_batch = None

    def _measure_prefill_route(self) -> None:
        """Which prefill chunks take the decode kernel and which torch's flash attention, timed
        on this CPU for this model's head layout (kernels/prefill_route.py)."""
        import time

        layer = self.attention_layers[0]
        start = time.perf_counter()
        limit, timings = prefill_route.measure_prefill_route(
            self.dtype, layer.num_heads, layer.num_kv_heads, layer.head_size, self.block_size
        )
        flash = cpu_prefill.FLASH_ROUTE.get(
            (self.dtype, layer.num_heads, layer.num_kv_heads, layer.head_size), "flash"
        )
        logger.info(
            "prefill attention route (measured in %.2f s): %s chunks of up to %d tokens through "
            "the decode kernel, longer through %s (first chunk, decode kernel / flash: %s)",
            time.perf_counter() - start,
            str(self.dtype).removeprefix("torch."),
            limit,
            flash,
            ", ".join(f"{n}: {d:.2f} / {f:.2f} ms" for n, (d, f) in timings.items()),
        )

    @torch.inference_mode()
    def capture_cuda_graphs(self, max_blocks_per_req: int) -> DecodeGraphs | None:
        """The decode forward captured per batch size (services/worker/cuda_graphs.py); None
        where every step runs eagerly."""
        return capture_decode_graphs(
            self.config, self._run_stage, self.device, max_blocks_per_req, self.max_model_len
        )

    @torch.inference_mode()
    def profile_run(self) -> None:
        """The largest step there can be, before the KV cache exists: max_num_batched_tokens
        prompt tokens over max_num_seqs requests, and their logits. Its peak memory is the
        activation memory the KV cache must leave free (vLLM's profile run)."""
        sched = self.config.scheduler
        num_tokens = min(sched.max_num_batched_tokens, sched.max_num_seqs * self.max_model_len)
        num_reqs = min(sched.max_num_seqs, num_tokens)
        query_lens = np.full(num_reqs, num_tokens // num_reqs, dtype=np.int32)
        query_lens[: num_tokens % num_reqs] += 1
        query_start_loc = np.zeros(num_reqs + 1, dtype=np.int32)
        np.cumsum(query_lens, out=query_start_loc[1:])
        positions = np.arange(num_tokens) - np.repeat(query_start_loc[:-1], query_lens)
        dev = self.device
        metadata = AttentionMetadata(
            query_start_loc=torch.from_numpy(query_start_loc).to(dev),
            seq_lens=torch.from_numpy(query_lens).to(dev),
            block_table=torch.zeros(num_reqs, 0, dtype=torch.int32, device=dev),
            slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=dev),
            max_query_len=int(query_lens.max()),
            max_seq_len=int(query_lens.max()),
        )
        hidden = self._run_stage(
            torch.zeros(num_tokens, dtype=torch.int64, device=dev),
            torch.from_numpy(positions).to(dev),
            metadata,
        )
        if self.is_last_stage:
            assert hidden is not None  # the last stage returns its hidden states
            last_rows = torch.from_numpy(query_start_loc[1:] - 1).to(dev)
            logits = self.model.compute_logits(hidden[last_rows])
            torch.softmax(logits.float(), dim=-1)  # the sampler's largest temporary

    def _timing_step(
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
        metadata.group_tables = [tables] * (len(self.kv_cache_groups) - 1)
        input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=dev)
        return input_ids, torch.from_numpy(positions).to(dev), metadata

    @torch.inference_mode()
    def _fit_decode_stack(self, status: str, tokens_per_request: int) -> str:
        """Time decode steps of 1, 2, 4, ... requests (64 cached tokens each, logits included)
        on the bound native stack and on the modules, best of three interleaved rounds, and
        keep the stack to the request counts where it is not slower (fit_stack_limit): on a
        CPU with AMX, oneDNN's bfloat16 tiles beat the stack's GEMV from ~10 requests; without
        AMX the stack wins to 16 and beyond. Returns the start-up log's status."""
        import time

        inner = self.model.model
        stack = inner.decode_stack
        assert stack is not None, "fitted only once bound"
        head = getattr(self.model, "lm_head", None)
        head_rows = head.native_rows if isinstance(head, ParallelLMHead) else 0
        max_requests = stack.max_requests
        counts = [c for c in (1, 2, 4, 8, 16, 32, 64) if c < max_requests] + [max_requests]
        steps = [self._timing_step(np.ones(c, dtype=np.int32), context=64) for c in counts]

        def run(step, on_stack: bool) -> float:
            inner.decode_stack = stack if on_stack else None
            if isinstance(head, ParallelLMHead):
                head.native_rows = head_rows if on_stack else 0
            start = time.perf_counter()
            hidden = self._run_stage(*step)
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
    def measure_step_costs(self) -> list[tuple[int, float]]:
        """Seconds of a verifying step (logits for every token) of 1, 2, 4, ... query tokens:
        what the adaptive speculation rule weighs drafts against
        (services/scheduler/core/spec_decode.py). The tokens are split into requests of up to
        1 + k each, as a verify step carries them, and the step runs against the bound KV
        cache (writing nothing), so it takes the path real steps take: the native decode
        stack while it holds them, the modules after. Empty unless adaptive speculation is
        on; every rank runs it (collectives), the driver's figures are used."""
        import time

        spec = self.spec_config
        if spec is None or not spec.adaptive:
            return []
        assert self.kv_caches, "the step costs are measured once the KV cache is bound"
        sched = self.config.scheduler
        limit = min(sched.max_num_batched_tokens, 4 * sched.max_num_seqs, 256)
        per_request = 1 + spec.num_speculative_tokens
        dev = self.device
        steps = []
        num_tokens = 1
        while num_tokens <= limit:
            num_reqs = min(-(-num_tokens // per_request), sched.max_num_seqs)
            query_lens = np.full(num_reqs, num_tokens // num_reqs, dtype=np.int32)
            query_lens[: num_tokens % num_reqs] += 1
            steps.append(self._timing_step(query_lens))
            num_tokens *= 2
        # Rounds over every size, the fastest of each kept: a burst of noise costs one
        # round of one size, not a size's every try (which would bend the curve the rule
        # reads its slopes from).
        best = [float("inf")] * len(steps)
        for _ in range(3):
            for i, (input_ids, positions_t, metadata) in enumerate(steps):
                start = time.perf_counter()
                hidden = self._run_stage(input_ids, positions_t, metadata)
                if self.is_last_stage:
                    assert hidden is not None  # the last stage returns its hidden states
                    self.model.compute_logits(hidden)
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                best[i] = min(best[i], time.perf_counter() - start)
        costs = [(len(input_ids), t) for (input_ids, _, _), t in zip(steps, best)]
        logger.info(
            "step costs for speculation: %s",
            ", ".join(f"{n} tokens {t * 1e3:.1f} ms" for n, t in costs),
        )
        return costs

    # ------------------------------------------------------------------ one step

    @property
    def batch(self) -> InputBatch:
        """The per-request input batch (made with the KV cache)."""
        assert self.input_batch is not None, "initialize_kv_cache makes the input batch"
        return self.input_batch

    def _update_states(self, so: SchedulerOutput) -> None:
        batch = self.batch
        lora = self.lora_manager
        for req_id in (*so.finished_req_ids, *so.preempted_req_ids):
            if lora is not None and req_id in batch.requests:
                lora.remove_request(batch.requests[req_id].row)
            batch.remove_request(req_id)
            if self.multimodal is not None:
                self.multimodal.remove_request(req_id)
        for new in so.scheduled_new_reqs:
            state = batch.add_request(new)
            if self.multimodal is not None:
                self.multimodal.add_request(new)
            if lora is not None:
                lora.add_request(state.row, new.lora_request)
        cached = so.scheduled_cached_reqs
        for req_id, block_ids, num_computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens
        ):
            row = batch.requests[req_id].row
            if block_ids:
                batch.append_block_ids(row, block_ids)
            batch.num_computed_tokens[row] = num_computed

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """One step: the KV connector's moves around it, and the forward when tokens run."""
        self._update_states(so)
        connector = self.kv_connector
        if connector is not None:
            connector.before_forward(so.kv_connector_metadata)
        output = self._execute(so) if so.total_num_scheduled_tokens else ModelRunnerOutput()
        if connector is not None:
            output.kv_connector_output = connector.after_forward(so.kv_connector_metadata)
        return output

    def _execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Prepare the inputs, run the forward, sample (or verify drafts), then propose."""
        step = prepare_inputs(so, self.batch, self.block_size, self.device)
        if self.lora_manager is not None:
            self.lora_manager.prepare_step(step.token_rows)
        if self.multimodal is not None:
            step.multimodal = self.multimodal.prepare(step)
        step.hidden = self._forward(step)
        if self.multimodal is not None:
            self.multimodal.after_step(step)
        if self.proposer is not None:
            self.proposer.after_forward(step)
        pooled = self._pool(step) if step.so.has_pooling else {}
        if len(step.sample_idx) and step.verifies_drafts:
            self._verify_drafts(step)
        elif len(step.sample_idx):
            self._sample(step)
        prompt_logprobs = self._prompt_logprobs(step) if self.is_last_stage else {}
        spec_token_ids = {}
        if self.proposer is not None:
            spec_token_ids = self.proposer.propose(step, self.batch)
        return ModelRunnerOutput(
            step.req_ids, step.sampled, step.logprobs, prompt_logprobs, spec_token_ids, b"", pooled
        )

    def _pool(self, step: StepBatch) -> dict[str, bytes]:
        """The embedding requests of the step: each chunk's hidden states pooled (the sum, for
        "mean"); once the prompt is done, the normalised vector (on the last pipeline stage,
        which has the hidden states). They sample nothing: on every rank they leave
        step.sample_idx."""
        pooled: dict[str, bytes] = {}
        pooling_idx = []
        starts = step.query_start_loc
        for i, state in enumerate(step.states):
            how = state.sampling_params.pooling
            if how is None:
                continue
            pooling_idx.append(i)
            if step.hidden is None:
                continue
            end = int(step.num_computed[i]) + int(step.num_scheduled[i])
            rows = step.hidden[int(starts[i]) : int(starts[i + 1])].float()
            if how == "mean":
                total = rows.sum(dim=0)
                state.pooled_sum = total if state.pooled_sum is None else state.pooled_sum + total
            if end < state.num_prompt_tokens:
                continue
            if how == "last":
                vector = rows[-1]
            else:
                assert state.pooled_sum is not None
                vector = state.pooled_sum / state.num_prompt_tokens
            vector = torch.nn.functional.normalize(vector, dim=0)
            pooled[state.req_id] = vector.cpu().numpy().astype(np.float32).tobytes()
        step.sample_idx = np.setdiff1d(step.sample_idx, pooling_idx)
        return pooled

    def _forward(self, step: StepBatch) -> torch.Tensor | None:
        graphs = self.cuda_graphs
        metadata = step.metadata
        if step.multimodal is not None:  # image embeddings or M-RoPE: the modules
            return self._run_stage(step.input_ids, step.positions, metadata, step.multimodal)
        if graphs is not None and graphs.can_run(
            len(step.rows), step.num_tokens, metadata.max_query_len
        ):
            return graphs.run(step.input_ids, step.positions, metadata)  # padded to a graph's size
        return self._run_stage(step.input_ids, step.positions, metadata)

    def _sample(self, step: StepBatch) -> None:
        """One token per sampling request; every rank appends it (next step's inputs)."""
        batch = self.batch
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

    # ------------------------------------------------------------------ speculative decoding

    def _verify_drafts(self, step: StepBatch) -> None:
        """Score every draft position and keep what the rejection sampler accepts; fills
        step.sampled and step.logprobs, and step.last_rows with the hidden row of each
        request's last emitted token (what a Medusa proposer reads)."""
        batch = self.batch
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
                emitted = self._verify_on_driver(step, logits, k)
        emitted_np = broadcast_from_driver(emitted).cpu().numpy()
        last_rows = step.query_start_loc[1:] - 1
        for j, (i, state) in enumerate(zip(sample_idx, states)):
            tokens = emitted_np[j][emitted_np[j] >= 0].tolist()
            for token_id in tokens:
                batch.append_token(state, token_id)
            step.sampled[i] = tokens
            last_rows[i] = starts[j] + len(tokens) - 1
        step.last_rows = last_rows

    def _verify_on_driver(self, step: StepBatch, logits: torch.Tensor, k: np.ndarray):
        """The driver's half of _verify_drafts: sampling metadata with one row per logits
        row (a row sees the drafts before it as output), then the rejection sampler."""
        batch = self.batch
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

    def _run_stage(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        multimodal: Any = None,
    ) -> torch.Tensor | None:
        """This pipeline stage's part of the forward: the final hidden states [T, hidden] on
        the last stage, None on the others (which send theirs to the next stage)."""
        intermediate = None
        if not self.is_first_stage:
            # The step's token count fixes the shape: (hidden, residual) as one [2, T, H].
            received = torch.empty(
                2, input_ids.shape[0], self.hidden_size, dtype=self.dtype, device=self.device
            )
            intermediate = tuple(recv_from_prev_stage(received).unbind(0))
        if multimodal is None:
            out = self.model(input_ids, positions, metadata, intermediate)
        else:  # a VLM's step with images (services/worker/multimodal.py)
            out = self.model(input_ids, positions, metadata, intermediate, multimodal=multimodal)
        if self.is_last_stage:
            return out
        send_to_next_stage(torch.stack(out))
        return None

    # ------------------------------------------------------------------ prompt logprobs

    def _prompt_logprobs(self, step: StepBatch) -> dict[str, Logprobs]:
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
            row = self.batch.token_ids[s.row]
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


def checkpoint_dtype(model_dir: str) -> str | None:
    """The dtype config.json names (`dtype`, or `torch_dtype` before transformers 5)."""
    import json
    import os

    path = os.path.join(model_dir, "config.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        config = json.load(f)
    return config.get("dtype") or config.get("torch_dtype")


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(
    dtype: str, device: torch.device, checkpoint_dtype: str | None = None
) -> torch.dtype:
    """--dtype as a torch dtype (vLLM's aliases already spelled out: ModelConfig.dtype_name).

    auto takes the checkpoint's dtype (config.json's `dtype` / `torch_dtype`), float32 when it
    names none. Two casts, as vLLM makes: a float32 checkpoint runs in bfloat16 on a GPU,
    and a float16 one in bfloat16 on a CPU (whose float16 GEMMs are slow or emulated).
    """
    if dtype != "auto":
        return _DTYPES[dtype]
    resolved = _DTYPES.get(str(checkpoint_dtype).removeprefix("torch."), torch.float32)
    if device.type == "cuda" and resolved == torch.float32:
        return torch.bfloat16
    if device.type == "cpu" and resolved == torch.float16:
        return torch.bfloat16
    return resolved


def effective_max_model_len(config: EngineConfig, hf_config) -> int:
    model_len = getattr(hf_config, "max_position_embeddings", None) or 2048
    wanted = config.model.max_model_len
    if wanted is None:
        return model_len
    if wanted > model_len:
        raise ValueError(f"max_model_len={wanted} exceeds the model's context length {model_len}")
    return wanted
