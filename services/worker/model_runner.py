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

import numpy as np
import torch

from kvserve.kernels import gemm
from kvserve.services.worker.cuda_graphs import DecodeGraphs, capture_decode_graphs
from kvserve.services.worker.input_batch import InputBatch, RequestState
from kvserve.services.worker.layers.attention import (
    Attention,
    AttentionMetadata,
    bind_kv_caches,
    kv_cache_bytes_per_block,
)
from kvserve.services.worker.layers.embed_head import ParallelLMHead
from kvserve.services.worker.layers.linear import LinearBase
from kvserve.services.worker.logits_processors import LogitsProcessorBatch
from kvserve.services.worker.model_loader import weights_identity
from kvserve.services.worker.models import load_model
from kvserve.services.worker.parallel_state import (
    broadcast_from_driver,
    get_tp_group,
    get_tp_rank,
    get_tp_size,
    is_driver,
    is_first_pp_rank,
    is_last_pp_rank,
    recv_from_prev_stage,
    send_to_next_stage,
)
from kvserve.services.worker.sampler import Sampler, compute_topk_logprobs
from kvserve.services.worker.sampling_metadata import LogprobsTensors, SamplingMetadata
from kvserve.services.worker.spec_decode.draft_model import DraftModelProposer
from kvserve.services.worker.spec_decode.ngram import NgramProposer
from kvserve.services.worker.spec_decode.rejection_sampler import verify
from kvserve.shared.config import EngineConfig, SpeculativeConfig
from kvserve.shared.logging import init_logger
from kvserve.shared.messages import KvFingerprint, Logprobs, ModelRunnerOutput, SchedulerOutput

logger = init_logger(__name__)


def _to_logprobs(t: LogprobsTensors) -> Logprobs:
    return Logprobs(t.token_ids.tolist(), t.logprobs.tolist(), t.ranks.tolist())


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
        self.ngram: NgramProposer | None = None
        self.draft: DraftModelProposer | None = None
        self.medusa = None
        self.eagle = None
        if self.spec_config is not None:
            self._init_proposer(self.spec_config)
        self.input_batch: InputBatch | None = None
        self.kv_caches: list[torch.Tensor] = []
        self.kv_connector = None  # a WorkerConnector, with --kv-transfer-config
        self.cuda_graphs: DecodeGraphs | None = None  # captured after the KV cache
        if config.kv_transfer_config is not None and not (
            self.is_first_stage and self.is_last_stage
        ):
            raise ValueError("KV transfer (--kv-transfer-config) does not run with PP > 1")

    # ------------------------------------------------------------------ GEMM paths

    def prepare_gemm(self) -> gemm.GemmPlan:
        """Measure (or reuse) the CPU GEMM plan of every linear layer and the LM head, and
        give each layer whose plan uses oneDNN its packed weight."""
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
            if shape_plan is None or "onednn" not in shape_plan.paths:
                continue
            key = module.weight.data_ptr()
            if key not in packed:
                packed[key] = gemm.pack_onednn(module.weight)
            module.gemm = gemm.LinearWeights(shape_plan, packed[key])
        how = plan.source
        if plan.source == "measured":
            how = f"measured in {plan.seconds:.1f} s"
            if plan.stalled_share is not None:
                how += f", tasks waited for a CPU {100 * plan.stalled_share:.0f}% of it"
        logger.info(
            "CPU GEMM plan (%s, %d threads): %s",
            how,
            torch.get_num_threads(),
            ", ".join(f"{k} {v}" for k, v in plan.summary().items()),
        )
        return plan

    def _init_proposer(self, spec: SpeculativeConfig) -> None:
        if spec.method == "ngram":
            self.ngram = NgramProposer(*spec.ngram_range)
        elif spec.method == "draft_model":
            self.draft = DraftModelProposer(
                spec, self.model, self.dtype, self.device, self.block_size
            )
        elif spec.method == "eagle":
            from kvserve.services.worker.spec_decode.eagle_proposer import EagleProposer

            self.eagle = EagleProposer(spec, self.model, self.dtype, self.device, self.block_size)
        else:
            from kvserve.services.worker.spec_decode.medusa import MedusaProposer

            if not (self.is_first_stage and self.is_last_stage):
                raise ValueError("medusa speculation does not run with pipeline parallelism")
            assert spec.model is not None, "SpeculativeConfig checks medusa has a model"
            self.medusa = MedusaProposer.load(spec.model, self.model, self.dtype, self.device)
            if spec.num_speculative_tokens > self.medusa.num_heads:
                raise ValueError(
                    f"num_speculative_tokens {spec.num_speculative_tokens} exceeds the "
                    f"{self.medusa.num_heads} Medusa heads of {spec.model}"
                )

    # ------------------------------------------------------------------ KV cache

    def kv_fingerprint(self) -> KvFingerprint:
        """This rank's block layout, as the KV connector's store keys it."""
        layer = self.attention_layers[0]
        return KvFingerprint(
            model=self.model_identity,  # not the served name: any node, any path
            dtype=str(self.dtype).removeprefix("torch."),
            block_size=self.block_size,
            num_layers=len(self.attention_layers),
            num_kv_heads=layer.num_kv_heads,
            head_size=layer.head_size,
            tp_rank=get_tp_rank(),
        )

    def kv_cache_bytes_per_block(self) -> int:
        """Bytes of one block over every layer (a draft model's own layers too)."""
        target = kv_cache_bytes_per_block(self.attention_layers, self.block_size, self.dtype)
        proposer = self.draft or self.eagle
        return target + (proposer.kv_cache_bytes_per_block() if proposer else 0)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate [2, num_blocks, block_size, Hkv, D] per layer and bind it to the layer."""
        self.kv_caches = bind_kv_caches(
            self.attention_layers, num_blocks, self.block_size, self.dtype, self.device
        )
        if self.draft is not None:
            self.draft.initialize_kv_cache(num_blocks)
        if self.eagle is not None:
            self.eagle.initialize_kv_cache(num_blocks)
        if self.config.kv_transfer_config is not None:
            from kvserve.services.kv_store.connector import WorkerConnector

            self.kv_connector = WorkerConnector(
                self.config.kv_transfer_config, self.kv_fingerprint(), self.kv_caches
            )
        max_blocks_per_req = -(-self.max_model_len // self.block_size)
        self.input_batch = InputBatch(
            self.config.scheduler.max_num_seqs,
            self.max_model_len,
            max_blocks_per_req,
            self.vocab_size,
        )
        logger.info(
            "KV cache: %d blocks of %d tokens, %.1f MiB",
            num_blocks,
            self.block_size,
            num_blocks * self.kv_cache_bytes_per_block() / 2**20,
        )
        self.cuda_graphs = self.capture_cuda_graphs(max_blocks_per_req)

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
            last_rows = torch.from_numpy(query_start_loc[1:] - 1).to(dev)
            logits = self.model.compute_logits(hidden[last_rows])
            torch.softmax(logits.float(), dim=-1)  # the sampler's largest temporary

    @torch.inference_mode()
    def measure_step_costs(self) -> list[tuple[int, float]]:
        """Seconds of a forward (with logits for every token, as a verifying step needs) for
        1, 2, 4, ... query tokens: what the adaptive speculation rule weighs drafts against
        (services/scheduler/core/spec_decode.py). Empty unless adaptive speculation is on; every
        rank runs it (collectives), the driver's figures are used."""
        import time

        spec = self.spec_config
        if spec is None or not spec.adaptive:
            return []
        sched = self.config.scheduler
        limit = min(sched.max_num_batched_tokens, 4 * sched.max_num_seqs, 256)
        dev = self.device
        costs = []
        num_tokens = 1
        while num_tokens <= limit:
            metadata = AttentionMetadata(
                query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=dev),
                seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=dev),
                block_table=torch.zeros(1, 0, dtype=torch.int32, device=dev),
                slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=dev),
                max_query_len=num_tokens,
                max_seq_len=num_tokens,
            )
            input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=dev)
            positions = torch.arange(num_tokens, device=dev)
            times = []
            for _ in range(3):
                start = time.perf_counter()
                hidden = self._run_stage(input_ids, positions, metadata)
                if self.is_last_stage:
                    self.model.compute_logits(hidden)
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                times.append(time.perf_counter() - start)
            costs.append((num_tokens, min(times)))
            num_tokens *= 2
        logger.info(
            "step costs for speculation: %s",
            ", ".join(f"{n} tokens {t * 1e3:.1f} ms" for n, t in costs),
        )
        return costs

    # ------------------------------------------------------------------ one step

    def _update_states(self, so: SchedulerOutput) -> None:
        batch = self.input_batch
        lora = self.lora_manager
        for req_id in (*so.finished_req_ids, *so.preempted_req_ids):
            if lora is not None and req_id in batch.requests:
                lora.remove_request(batch.requests[req_id].row)
            batch.remove_request(req_id)
        for new in so.scheduled_new_reqs:
            state = batch.add_request(new)
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
        self._update_states(so)
        kv_loaded = self._kv_before_forward(so) if self.kv_connector is not None else {}
        if so.total_num_scheduled_tokens == 0:
            return self._kv_after_forward(so, ModelRunnerOutput(), kv_loaded)
        output = self._execute(so)
        if self.kv_connector is not None:
            output = self._kv_after_forward(so, output, kv_loaded)
        return output

    def _kv_before_forward(self, so: SchedulerOutput) -> dict[str, int]:
        """Copy out the evicted blocks (their slots are rewritten by this step), then load
        the external hits; every TP rank keeps the smallest count any rank loaded."""
        connector = self.kv_connector
        assert connector is not None
        if so.kv_saves_before:
            connector.save(so.kv_saves_before)
        if not so.kv_loads:
            return {}
        loaded = connector.load(so.kv_loads)
        if get_tp_size() > 1:
            counts = torch.tensor([loaded[t.req_id] for t in so.kv_loads], dtype=torch.int64)
            torch.distributed.all_reduce(
                counts, op=torch.distributed.ReduceOp.MIN, group=get_tp_group()
            )
            loaded = {t.req_id: int(n) for t, n in zip(so.kv_loads, counts)}
        return loaded

    def _kv_after_forward(
        self, so: SchedulerOutput, output: ModelRunnerOutput, kv_loaded: dict[str, int]
    ) -> ModelRunnerOutput:
        connector = self.kv_connector
        if connector is None:
            return output
        if so.kv_saves:
            connector.save(so.kv_saves)
        seconds, bytes_loaded, bytes_saved = connector.take_stats()
        output.kv_loaded = kv_loaded
        output.kv_store_ok = connector.store_up
        output.kv_transfer_seconds = seconds
        output.kv_bytes_loaded = bytes_loaded
        output.kv_bytes_saved = bytes_saved
        return output

    def _execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        batch = self.input_batch
        req_ids = list(so.num_scheduled_tokens)
        states = [batch.requests[r] for r in req_ids]
        rows = np.fromiter((s.row for s in states), dtype=np.int64, count=len(states))
        num_scheduled = np.fromiter(
            so.num_scheduled_tokens.values(), dtype=np.int64, count=len(req_ids)
        )
        num_computed = batch.num_computed_tokens[rows]
        # Speculative decoding: drafts follow each request's known tokens in its row, so the
        # inputs below pick them up (num_tokens does not count them).
        num_drafts = np.zeros(len(req_ids), dtype=np.int64)
        spec_decode_tokens = so.scheduled_spec_decode_tokens
        if spec_decode_tokens:
            for i, req_id in enumerate(req_ids):
                drafts = spec_decode_tokens.get(req_id)
                if drafts:
                    row, n = rows[i], batch.num_tokens[rows[i]]
                    batch.token_ids[row, n : n + len(drafts)] = drafts
                    num_drafts[i] = len(drafts)

        # Example: num_scheduled = [3, 1, 2], num_computed = [0, 7, 4]
        #   query_start_loc = [0, 3, 4, 6]; req_indices = [0 0 0 1 2 2]
        #   positions = [0 1 2 | 7 | 4 5]
        query_start_loc = np.zeros(len(rows) + 1, dtype=np.int32)
        np.cumsum(num_scheduled, out=query_start_loc[1:])
        total = int(query_start_loc[-1])
        req_indices = np.repeat(np.arange(len(rows)), num_scheduled)
        offsets = np.arange(total) - np.repeat(query_start_loc[:-1], num_scheduled)
        positions = num_computed[req_indices] + offsets
        token_rows = rows[req_indices]
        input_ids = batch.token_ids[token_rows, positions]
        if self.lora_manager is not None:
            self.lora_manager.prepare_step(token_rows)
        block_size = self.block_size
        slot_mapping = (
            batch.block_table[token_rows, positions // block_size].astype(np.int64) * block_size
            + positions % block_size
        )
        seq_lens = (num_computed + num_scheduled).astype(np.int32)
        max_seq_len = int(seq_lens.max())
        num_blocks_needed = -(-max_seq_len // block_size)

        dev = self.device
        metadata = AttentionMetadata(
            query_start_loc=torch.from_numpy(query_start_loc).to(dev),
            seq_lens=torch.from_numpy(seq_lens).to(dev),
            block_table=torch.from_numpy(
                np.ascontiguousarray(batch.block_table[rows, :num_blocks_needed])
            ).to(dev),
            slot_mapping=torch.from_numpy(slot_mapping).to(dev),
            max_query_len=int(num_scheduled.max()),
            max_seq_len=max_seq_len,
        )
        input_ids_t = torch.from_numpy(input_ids).to(dev)
        positions_t = torch.from_numpy(positions).to(dev)
        graphs = self.cuda_graphs
        if graphs is not None and graphs.can_run(len(rows), total, metadata.max_query_len):
            hidden = graphs.run(input_ids_t, positions_t, metadata)  # padded to a graph's size
        else:
            hidden = self._run_stage(input_ids_t, positions_t, metadata)
        if self.draft is not None:
            self.draft.catch_up(input_ids_t, positions_t, metadata)

        # A request samples once its context reaches every token it has (the prompt chunk, or
        # the whole prompt plus outputs after a resume, is done).
        samples = seq_lens >= batch.num_tokens[rows]
        sample_idx = np.flatnonzero(samples)
        sampled: list[list[int]] = [[] for _ in req_ids]
        logprobs: dict[str, Logprobs] = {}
        last_rows = query_start_loc[1:] - 1  # the hidden row of each request's last token
        if len(sample_idx) and spec_decode_tokens:
            last_rows = self._verify_drafts(
                so, states, rows, sample_idx, num_drafts, hidden, query_start_loc, sampled, logprobs
            )
        elif len(sample_idx):
            sample_states = [states[i] for i in sample_idx]
            sampled_ids = torch.empty(len(sample_idx), dtype=torch.int64, device=dev)
            if self.is_last_stage:
                logits_indices = torch.from_numpy(query_start_loc[1:][sample_idx] - 1).to(dev)
                # Every TP rank of the stage takes part: the LM head all-gathers.
                logits = self.model.compute_logits(hidden[logits_indices])
                if self.is_driver:
                    out = self.sampler(
                        logits, self._sampling_metadata(sample_states, rows[sample_idx], so)
                    )
                    sampled_ids = out.sampled_token_ids
                    if out.logprobs is not None:
                        logprobs = self._split_logprobs(sample_states, out.logprobs)
            # Every rank keeps every request's tokens, to build the next step's inputs.
            token_ids = broadcast_from_driver(sampled_ids).tolist()
            for i, state, token_id in zip(sample_idx, sample_states, token_ids):
                batch.append_token(state, token_id)
                sampled[i] = [token_id]
        prompt_logprobs = {}
        if self.is_last_stage:
            prompt_logprobs = self._prompt_logprobs(
                states, hidden, query_start_loc, num_computed, num_scheduled
            )
        spec_token_ids = {}
        if self.eagle is not None:
            spec_token_ids = self._eagle_step(
                so, states, rows, num_computed, num_scheduled, num_drafts, query_start_loc, hidden,
                sampled,
            )  # fmt: skip
        elif so.num_spec_tokens_to_propose and len(sample_idx):
            spec_token_ids = self._propose(so, states, rows, sample_idx, hidden, last_rows)
        return ModelRunnerOutput(req_ids, sampled, logprobs, prompt_logprobs, spec_token_ids)

    # ------------------------------------------------------------------ speculative decoding

    def _verify_drafts(
        self, so, states, rows, sample_idx, num_drafts, hidden, query_start_loc, sampled, logprobs
    ) -> np.ndarray:
        """Score every draft position and keep what the rejection sampler accepts; fills
        `sampled` and `logprobs` and returns the hidden row of each request's last emitted
        token (what a Medusa proposer reads)."""
        batch = self.input_batch
        dev = self.device
        sample_states = [states[i] for i in sample_idx]
        sample_rows = rows[sample_idx]
        k = num_drafts[sample_idx]
        counts = k + 1
        ends = query_start_loc[1:][sample_idx]
        # Example: k = [2, 0], ends = [3, 7] -> logits rows [0 1 2 | 6]
        starts = ends - counts
        offsets = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
        logits_rows = np.repeat(starts, counts) + offsets
        max_k = int(k.max())
        emitted = torch.empty(len(sample_idx), max_k + 1, dtype=torch.int64, device=dev)
        if self.is_last_stage:
            logits = self.model.compute_logits(hidden[torch.from_numpy(logits_rows).to(dev)])
            if self.is_driver:
                emitted, lp = self._verify_on_driver(
                    logits, sample_states, sample_rows, k, so, counts
                )
                if lp is not None:
                    logprobs.update(lp)
        emitted_np = broadcast_from_driver(emitted).cpu().numpy()
        last_rows = query_start_loc[1:] - 1
        for j, (i, state) in enumerate(zip(sample_idx, sample_states)):
            tokens = emitted_np[j][emitted_np[j] >= 0].tolist()
            for token_id in tokens:
                batch.append_token(state, token_id)
            sampled[i] = tokens
            last_rows[i] = starts[j] + len(tokens) - 1
        return last_rows

    def _verify_on_driver(self, logits, states, rows, k, so, counts):
        """The driver's half of _verify_drafts: sampling metadata with one row per logits
        row (a row sees the drafts before it as output), then the rejection sampler."""
        batch = self.input_batch
        spec = so.scheduled_spec_decode_tokens
        drafts = [spec.get(s.req_id, []) for s in states]
        expanded_states = [s for s, n in zip(states, counts) for _ in range(n)]
        prefixes = [d[:j] for d, n in zip(drafts, counts) for j in range(n)]
        md = self._sampling_metadata(expanded_states, np.repeat(rows, counts), so, prefixes)
        draft_ids = torch.tensor([t for d in drafts for t in d], dtype=torch.int64)
        is_greedy = torch.from_numpy(batch.temperature[rows] < 1e-5)
        generators = {i: s.generator for i, s in enumerate(states) if s.generator is not None}
        emitted, lp = verify(self.sampler, logits, md, draft_ids, k.tolist(), is_greedy, generators)
        if lp is None:
            return emitted, None
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
        return emitted, out

    def _eagle_step(
        self, so, states, rows, num_computed, num_scheduled, num_drafts, query_start_loc, hidden,
        sampled,
    ) -> dict[str, list[int]]:  # fmt: skip
        """The EAGLE head's catch-up on every verified position of the step, then its
        guesses for the requests asked for drafts (every rank runs it)."""
        assert self.eagle is not None
        batch = self.input_batch
        emitted = np.fromiter((len(t) for t in sampled), np.int64, len(sampled))
        # A request that sampled verified its last token's position and its accepted drafts
        # (emitted - 1); a prompt chunk, all of its positions.
        num_verified = np.where(
            emitted > 0, num_scheduled - num_drafts - 1 + emitted, num_scheduled
        )
        offsets = np.arange(int(num_verified.sum())) - np.repeat(
            np.cumsum(num_verified) - num_verified, num_verified
        )
        hidden_rows = np.repeat(query_start_loc[:-1].astype(np.int64), num_verified) + offsets
        wanted = so.num_spec_tokens_to_propose
        num_wanted = np.fromiter(
            (wanted.get(s.req_id, 0) if n else 0 for s, n in zip(states, emitted)),
            np.int64,
            len(states),
        )
        num_wanted = np.minimum(num_wanted, self.max_model_len - batch.num_tokens[rows])
        guesses = self.eagle.step(
            rows, batch.token_ids, batch.block_table, batch.num_blocks, num_computed,
            num_verified, hidden_rows, hidden, np.maximum(num_wanted, 0),
        )  # fmt: skip
        return {s.req_id: g for s, g in zip(states, guesses) if g}

    def _propose(self, so, states, rows, sample_idx, hidden, last_rows) -> dict[str, list[int]]:
        """The next step's drafts of the requests that sampled (only the driver's reach
        the scheduler; a draft model and Medusa run on every rank of their TP group)."""
        batch = self.input_batch
        wanted = so.num_spec_tokens_to_propose
        idx = [i for i in sample_idx if wanted.get(states[i].req_id, 0) > 0]
        if not idx:
            return {}
        prop_states = [states[i] for i in idx]
        prop_rows = rows[idx]
        num = np.fromiter((wanted[s.req_id] for s in prop_states), np.int64, len(idx))
        num_tokens = batch.num_tokens[prop_rows]
        # Never past max_model_len, nor past the slots the request holds for a draft's
        # own steps.
        num = np.minimum(num, self.max_model_len - num_tokens)
        if self.ngram is not None:
            if not self.is_driver:
                return {}
            proposals = self.ngram.propose(
                [batch.token_ids[r, :n] for r, n in zip(prop_rows, num_tokens)], num.tolist()
            )
        elif self.draft is not None:
            slots = batch.num_blocks[prop_rows] * self.block_size
            num = np.maximum(np.minimum(num, slots - (num_tokens - 1)), 0)
            lora = self.lora_manager
            proposals = self.draft.propose(
                batch.token_ids[prop_rows, num_tokens - 1],
                num_tokens,
                batch.block_table[prop_rows],
                num,
                None if lora is None else (lambda active: lora.prepare_step(prop_rows[active])),
            )
        else:
            assert self.medusa is not None
            rows_t = torch.from_numpy(last_rows[idx]).to(self.device)
            guesses = self.medusa.propose(hidden[rows_t], int(num.max())).cpu().tolist()
            proposals = [g[:n] for g, n in zip(guesses, num.tolist())]
        return {s.req_id: p for s, p in zip(prop_states, proposals) if p}

    def _run_stage(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
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
        out = self.model(input_ids, positions, metadata, intermediate)
        if self.is_last_stage:
            return out
        send_to_next_stage(torch.stack(out))
        return None

    # ------------------------------------------------------------------ sampling inputs

    def _sampling_metadata(
        self,
        states: list[RequestState],
        rows: np.ndarray,
        so: SchedulerOutput,
        draft_prefixes: list[list[int]] | None = None,
    ) -> SamplingMetadata:
        """One row per entry of `states`; with draft_prefixes (speculative decoding), row i
        scores the position after draft_prefixes[i], which counts as output for penalties,
        min_tokens and logits processors."""
        b = self.input_batch
        if draft_prefixes is None:
            outputs = [s.output_token_ids for s in states]
        else:
            outputs = [s.output_token_ids + p for s, p in zip(states, draft_prefixes)]
        temperature = b.temperature[rows]
        greedy = temperature < 1e-5
        all_greedy = bool(greedy.all())
        md = SamplingMetadata(
            temperature=None if all_greedy else torch.from_numpy(temperature),
            all_greedy=all_greedy,
            all_random=not bool(greedy.any()),
        )
        if not all_greedy:
            top_p, top_k, min_p = b.top_p[rows], b.top_k[rows], b.min_p[rows]
            md.top_p = torch.from_numpy(top_p) if (top_p < 1.0).any() else None
            md.top_k = torch.from_numpy(top_k) if (top_k > 0).any() else None
            md.min_p = torch.from_numpy(min_p) if (min_p > 0.0).any() else None
            md.generators = {i: s.generator for i, s in enumerate(states) if s.generator}
        wanted = [
            s.sampling_params.logprobs for s in states if s.sampling_params.logprobs is not None
        ]
        md.max_num_logprobs = max(wanted) if wanted else None

        presence, frequency = b.presence_penalty[rows], b.frequency_penalty[rows]
        repetition = b.repetition_penalty[rows]
        md.no_penalties = not (
            (presence != 0).any() or (frequency != 0).any() or (repetition != 1).any()
        )
        needs_outputs = not md.no_penalties
        for i, s in enumerate(states):
            p = s.sampling_params
            if len(outputs[i]) < p.min_tokens:
                forbidden = set(p.stop_token_ids or ())
                if s.eos_token_id is not None:
                    forbidden.add(s.eos_token_id)
                md.min_tokens[i] = (p.min_tokens, forbidden)
                needs_outputs = True
        if needs_outputs:
            md.output_token_ids = outputs
        if not md.no_penalties:
            md.presence_penalties = torch.from_numpy(presence)
            md.frequency_penalties = torch.from_numpy(frequency)
            md.repetition_penalties = torch.from_numpy(repetition)
            if (repetition != 1).any():
                md.prompt_token_ids = self._padded_prompts(states)
        if so.grammar_req_ids:
            md.grammar_bitmask, md.grammar_rows = self._grammar_rows(states, so)
        if b.num_logits_processor_reqs:
            with_processors = [
                (i, s.logits_processors, outputs[i])
                for i, s in enumerate(states)
                if s.logits_processors is not None
            ]
            if with_processors:
                md.logits_processors = LogitsProcessorBatch.gather(with_processors)
        return md

    @staticmethod
    def _grammar_rows(
        states: list[RequestState], so: SchedulerOutput
    ) -> tuple[np.ndarray, np.ndarray]:
        """The step's bitmask as [N, W] int32 (a view of the message's bytes), and the
        sampling row of each of its rows."""
        row_of = {s.req_id: i for i, s in enumerate(states)}
        bitmask = np.frombuffer(so.grammar_bitmask, dtype=np.int32).reshape(
            len(so.grammar_req_ids), -1
        )
        rows = np.fromiter((row_of[r] for r in so.grammar_req_ids), np.int64, len(bitmask))
        return bitmask, rows

    def _padded_prompts(self, states: list[RequestState]) -> torch.Tensor:
        width = max(len(s.prompt_token_ids) for s in states) or 1
        out = torch.full((len(states), width), self.vocab_size, dtype=torch.int64)
        for i, s in enumerate(states):
            out[i, : len(s.prompt_token_ids)] = torch.tensor(s.prompt_token_ids, dtype=torch.int64)
        return out

    @staticmethod
    def _split_logprobs(states: list[RequestState], t: LogprobsTensors) -> dict[str, Logprobs]:
        out = {}
        for i, s in enumerate(states):
            n = s.sampling_params.logprobs
            if n is None:
                continue
            out[s.req_id] = Logprobs(
                t.token_ids[i : i + 1, : n + 1].tolist(),
                t.logprobs[i : i + 1, : n + 1].tolist(),
                t.ranks[i : i + 1].tolist(),
            )
        return out

    def _prompt_logprobs(
        self, states, hidden, query_start_loc, num_computed, num_scheduled
    ) -> dict[str, Logprobs]:
        """Logprobs of each prompt token given the ones before it, for requests that ask.

        The hidden state at position p predicts token p + 1, so a chunk covering positions
        [c, c + n) yields logprobs for prompt tokens c + 1 .. min(c + n, num_prompt - 1).
        """
        out = {}
        for i, s in enumerate(states):
            k = s.sampling_params.prompt_logprobs
            if k is None:
                continue
            start = int(num_computed[i])
            end = min(start + int(num_scheduled[i]), s.num_prompt_tokens - 1)
            if end <= start:
                continue
            q0 = int(query_start_loc[i])
            logits = self.model.compute_logits(hidden[q0 : q0 + end - start])  # TP collective
            if not self.is_driver:
                continue  # only the driver's answer reaches the engine core
            row = self.input_batch.token_ids[s.row]
            targets = torch.from_numpy(row[start + 1 : end + 1].copy()).to(logits.device)
            lp = torch.log_softmax(logits, dim=-1)
            out[s.req_id] = _to_logprobs(compute_topk_logprobs(lp, targets, k))
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
