"""ModelRunner: turns a SchedulerOutput into one flattened forward pass and sampled tokens.

Under TP x PP every rank runs this same step on the same SchedulerOutput, so every rank
builds the same inputs. One step (synchronous pipeline: one step in flight):

    stage 0:       embed + its layers --send (hidden, residual)--> stage 1
    stage 1..:     recv --> its layers --send--> next stage
    last stage:    recv --> its layers --> norm --> logits (all-gathered over TP)
    driver rank:   sample --broadcast sampled ids--> every rank appends them

Only the driver (TP rank 0 of the last stage) samples: the others would do the same work for
the same result, and on a shared CPU that work is taken from the driver.

The step here is: update the per-request states, prepare the inputs (step_inputs.py), run the
forward (this stage's part, or a captured CUDA graph), then sample or verify drafts
(step_sampler.py), pool embeddings (pooling.py), and propose drafts (spec_decode/). Start-up
work lives beside it: the dtype (dtype.py), the CPU tuning (cpu_tuning.py) and the timed
steps it measures with (step_timing.py).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvserve.kernels import cpu
from kvserve.services.kv_store.connector import WorkerConnector
from kvserve.services.worker.cpu_tuning import measure_prefill_route, prepare_gemm
from kvserve.services.worker.cuda_graphs import DecodeGraphs, capture_decode_graphs
from kvserve.services.worker.dtype import checkpoint_dtype, resolve_dtype
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
from kvserve.services.worker.model_loader import weights_identity
from kvserve.services.worker.models import load_model
from kvserve.services.worker.models.native_decode import bind_decode_stack
from kvserve.services.worker.parallel_state import (
    get_tp_rank,
    get_tp_size,
    is_driver,
    is_first_pp_rank,
    is_last_pp_rank,
    recv_from_prev_stage,
    send_to_next_stage,
)
from kvserve.services.worker.pooling import encoder_token_types, pool_step
from kvserve.services.worker.sampler import Sampler
from kvserve.services.worker.spec_decode.proposer import Proposer, ProposerContext
from kvserve.services.worker.spec_decode.registry import make_proposer
from kvserve.services.worker.step_inputs import StepBatch, prepare_inputs
from kvserve.services.worker.step_sampler import StepSampler
from kvserve.services.worker.step_timing import StepTimer, prompt_keys_per_token
from kvserve.shared import env
from kvserve.shared.config import EngineConfig, SpeculativeConfig
from kvserve.shared.kv_cache_groups import KVCacheGroupSpec, group_size_of
from kvserve.shared.logging import init_logger
from kvserve.shared.messages import KvFingerprint, ModelRunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from kvserve.services.worker.lora.manager import LoRAManager
    from kvserve.services.worker.multimodal import MultimodalRunner

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
        self.model_dir = model_dir
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
        # XLM-R's positions start at padding_idx + 1: its table holds fewer tokens.
        self.max_model_len = min(
            self.max_model_len, getattr(self.model, "max_positions", self.max_model_len)
        )
        self.block_size = config.cache.block_size
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        self.is_encoder = bool(getattr(self.model, "is_encoder", False))
        self.kv_cache_groups = self._plan_kv_cache_groups()
        # --kv-cache-dtype: the model's dtype, or fp8 with each layer's scales (kv_scales.py).
        self.kv_cache_dtype = resolve_kv_cache_dtype(config.cache.cache_dtype, self.dtype)
        check_layers_take(self.kv_cache_dtype, self.attention_layers)
        # LoRA wraps the linear layers before the GEMM plan, which finds them inside.
        self.lora_manager = self._make_lora_manager()
        self.gemm_plan = prepare_gemm(self.model, config) if device.type == "cpu" else None
        self.sampler = Sampler()
        self.step_sampler = StepSampler(
            self.model, self.sampler, device, self.is_last_stage, self.is_driver
        )
        self.step_timer = StepTimer(
            self.model,
            self._run_stage,
            self.dtype,
            device,
            self.block_size,
            len(self.kv_cache_groups),
            self.is_last_stage,
        )
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
        self.multimodal = self._make_multimodal()
        if config.kv_transfer_config is not None and not (
            self.is_first_stage and self.is_last_stage
        ):
            raise ValueError("KV transfer (--kv-transfer-config) does not run with PP > 1")

    def _plan_kv_cache_groups(self) -> list[KVCacheGroupSpec]:
        # An encoder (BERT, XLM-R, ModernBERT) keeps no KV cache: its blocks are the
        # scheduler's bookkeeping only (layers/bidirectional.py), one group of no layers.
        if self.is_encoder:
            return [KVCacheGroupSpec(layer_indices=[])]
        single_stage = self.is_first_stage and self.is_last_stage
        return plan_kv_cache_groups(self.config, self.attention_layers, single_stage)

    def _make_lora_manager(self) -> LoRAManager | None:
        """The adapters' manager with --enable-lora (it wraps the model's linear layers)."""
        if not self.config.lora.enable_lora:
            return None
        from kvserve.services.worker.lora.manager import LoRAManager

        max_num_seqs = self.config.scheduler.max_num_seqs
        return LoRAManager(self.model, self.config.lora, max_num_seqs, self.dtype, self.device)

    def _make_multimodal(self) -> MultimodalRunner | None:
        """The vision encoder's runner, for a model that takes images."""
        if not getattr(self.model, "supports_images", False):
            return None
        from kvserve.services.worker.multimodal import MultimodalRunner

        return MultimodalRunner(self.model, self.device)

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
            model_dir=self.model_dir,
            quantization=self.config.model.quantization,
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
        if self.is_encoder:
            return  # no decode steps: no graphs, no decode stack, no prefill route
        one_table = len(self.kv_cache_groups) == 1  # what the graphs and the C stack read
        self.cuda_graphs = self.capture_cuda_graphs(max_blocks_per_req) if one_table else None
        if self.device.type == "cpu":
            self._bind_cpu_kernels(one_table)

    def _bind_cpu_kernels(self, one_table: bool) -> None:
        """Bind the native decode stack to the new cache and, the first time, measure what
        the CPU paths are best at: the stack's request limit and the prefill route.

        Args:
            one_table: the layers read one block table (the stack reads no other).
        """
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
            status = self.step_timer.fit_decode_stack(status, tokens)
            fitted = getattr(self.model.model, "decode_stack", None)
            self._fitted_stack_rows = fitted.max_requests if fitted is not None else 0
        logger.info("native decode stack %s", status)
        if cpu.available(self.dtype) and env.PREFILL_ROUTE_MEASURE.get() and measure:
            measure_prefill_route(self.dtype, self.attention_layers[0], self.block_size)
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
        if self.is_last_stage and not self.is_encoder:
            assert hidden is not None  # the last stage returns its hidden states
            last_rows = torch.from_numpy(query_start_loc[1:] - 1).to(dev)
            logits = self.model.compute_logits(hidden[last_rows])
            torch.softmax(logits.float(), dim=-1)  # the sampler's largest temporary

    def prompt_keys_per_token(self) -> float:
        """Attended keys whose attention costs what one prompt token's linear layers cost
        (step_timing.prompt_keys_per_token): the latency targets' step-time model prices
        a prompt chunk's attention with it."""
        return prompt_keys_per_token(self.model, self.attention_layers)

    @torch.inference_mode()
    def measure_step_costs(self) -> list[tuple[int, float]]:
        """Seconds of a verifying step (logits for every token) of 1, 2, 4, ... query tokens:
        what the adaptive speculation rule weighs drafts against
        (services/scheduler/core/spec_decode.py). The tokens are split into requests of up to
        1 + k each, as a verify step carries them, and the step runs against the bound KV
        cache (writing nothing), so it takes the path real steps take: the native decode
        stack while it holds them, the modules after. Without speculation, where latency
        targets are expected (SchedulerConfig.expects_targets), prompt steps instead
        (StepTimer.measure_prompt_costs); else empty. Every rank runs it (collectives),
        the driver's figures are used. A table in KVSERVE_SPEC_STEP_COSTS replaces the
        speculation's timing (shared/env.py)."""
        spec = self.spec_config
        if spec is None and self.config.scheduler.expects_targets:
            assert self.kv_caches, "the step costs are measured once the KV cache is bound"
            return self.step_timer.measure_prompt_costs(self.config.scheduler)
        if spec is None or not spec.adaptive:
            return []
        fixed = env.SPEC_STEP_COSTS.get()
        if fixed is not None:
            return fixed
        assert self.kv_caches, "the step costs are measured once the KV cache is bound"
        return self.step_timer.measure_step_costs(
            spec.num_speculative_tokens, self.config.scheduler
        )

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
        pooled = pool_step(step, self.model) if step.so.has_pooling else {}
        if len(step.sample_idx) and step.verifies_drafts:
            self.step_sampler.verify_drafts(step, self.batch)
        elif len(step.sample_idx):
            self.step_sampler.sample(step, self.batch)
        prompt_logprobs = {}
        if self.is_last_stage:
            prompt_logprobs = self.step_sampler.prompt_logprobs(step, self.batch)
        spec_token_ids = {}
        if self.proposer is not None:
            spec_token_ids = self.proposer.propose(step, self.batch)
        return ModelRunnerOutput(
            step.req_ids, step.sampled, step.logprobs, prompt_logprobs, spec_token_ids, b"", pooled
        )

    def _forward(self, step: StepBatch) -> torch.Tensor | None:
        graphs = self.cuda_graphs
        metadata = step.metadata
        if self.is_encoder:  # whole requests, bidirectional (layers/bidirectional.py)
            return self.model(
                step.input_ids, step.positions, metadata, None, encoder_token_types(step)
            )
        if step.multimodal is not None:  # image embeddings or M-RoPE: the modules
            return self._run_stage(step.input_ids, step.positions, metadata, step.multimodal)
        if graphs is not None and graphs.can_run(
            len(step.rows), step.num_tokens, metadata.max_query_len
        ):
            return graphs.run(step.input_ids, step.positions, metadata)  # padded to a graph's size
        return self._run_stage(step.input_ids, step.positions, metadata)

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


def effective_max_model_len(config: EngineConfig, hf_config) -> int:
    model_len = getattr(hf_config, "max_position_embeddings", None) or 2048
    wanted = config.model.max_model_len
    if wanted is None:
        return model_len
    if wanted > model_len:
        raise ValueError(f"max_model_len={wanted} exceeds the model's context length {model_len}")
    return wanted
