"""CUDA graphs of the decode forward: one per capture size, replayed for pure-decode steps.

vLLM's CUDA graph wrapper in small. After the KV cache exists, the model runner captures the
forward of a pure-decode batch (one token per request) for each capture size, largest first,
every graph in one shared memory pool. Each graph reads its inputs from static buffers sized
for the largest batch:

    input_ids, positions, slot_mapping  [max_size]                      int64
    seq_lens                            [max_size]                      int32
    query_start_loc                     [max_size + 1]                  int32, 0 1 2 ... (fixed)
    block_table                         [max_size, max_blocks_per_seq]  int32

A decode step of n requests runs in the smallest captured size b >= n. Its inputs fill rows
0..n-1; rows n..b-1 are padding: slot -1 (writes no K/V), seq_len 1 over the null block 0.
The graph replays and the first n rows of its output are the step's hidden states:

    n = 3, b = 4:   input_ids [t0 t1 t2 0]   slot_mapping [s0 s1 s2 -1]   seq_lens [l0 l1 l2 1]

Any other step (a prompt chunk, drafts to verify, more requests than the largest size) runs
eagerly. What records a graph is a strategy: `CudaGraphBackend` captures torch.cuda graphs,
`EagerBackend` re-runs the forward over the same static buffers, which lets a CPU test check
the padding and copying against the plain eager step.
"""

from __future__ import annotations

import bisect
import functools
import time
from collections.abc import Callable
from typing import Protocol

import torch

from kvserve.services.worker.layers.attention import AttentionMetadata
from kvserve.shared.config import EngineConfig
from kvserve.shared.logging import init_logger

logger = init_logger(__name__)

Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor | None]
Replay = Callable[[], torch.Tensor]

# vLLM's default decode sizes: 1, 2, 4, then every multiple of 8 up to 256.
_DEFAULT_SIZES = (1, 2, 4, *range(8, 257, 8))


def capture_sizes(wanted: list[int] | None, max_num_seqs: int, max_num_tokens: int) -> list[int]:
    """The decode batch sizes to capture, ascending: `wanted` (--cuda-graph-sizes) or the
    defaults, none above what one step can hold (max_num_seqs requests, max_num_tokens
    tokens). With the defaults that largest batch is captured too, so it never runs eagerly."""
    limit = min(max_num_seqs, max_num_tokens)
    sizes = {n for n in (_DEFAULT_SIZES if wanted is None else wanted) if n <= limit}
    if wanted is None and limit <= _DEFAULT_SIZES[-1]:
        sizes.add(limit)
    return sorted(sizes)


class GraphBackend(Protocol):
    def capture(self, forward: Replay) -> Replay:
        """Record `forward` (which reads the static buffers) and return what replays it."""
        ...


class EagerBackend:
    """No graph (CPU tests of the static-buffer path): the forward runs once at capture, as
    the CUDA warm-up does, and again at each replay."""

    def capture(self, forward: Replay) -> Replay:
        forward()
        return forward


class CudaGraphBackend:
    """torch.cuda graphs sharing one memory pool; warm-up runs first compile the Triton
    kernels and set up cuBLAS, neither of which may happen during a capture."""

    def __init__(self, device: torch.device, num_warmups: int = 2):
        self.device = device
        self.num_warmups = num_warmups
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: list[torch.cuda.CUDAGraph] = []

    def capture(self, forward: Replay) -> Replay:
        for _ in range(self.num_warmups):
            forward()
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = forward()
        self.graphs.append(graph)

        def replay() -> torch.Tensor:
            graph.replay()
            return output  # overwritten by the next replay of any graph of the pool

        return replay


class DecodeGraphs:
    """The captured decode forwards and their static input buffers.

    Args:
        forward: the model forward, (input_ids, positions, metadata) -> hidden [T, H].
        sizes: the batch sizes to capture (see `capture_sizes`).
        max_blocks_per_seq: the block table's width (max_model_len / block_size, rounded up).
        max_seq_len: the host-side bound every captured step passes (max_model_len).
        device: where the buffers live.
        backend: what records and replays a graph.
    """

    def __init__(
        self,
        forward: Forward,
        sizes: list[int],
        max_blocks_per_seq: int,
        max_seq_len: int,
        device: torch.device,
        backend: GraphBackend,
    ):
        assert sizes, "no capture size"
        self.forward = forward
        self.sizes = sorted(set(sizes))
        self.max_size = self.sizes[-1]
        self.max_seq_len = max_seq_len
        self.backend = backend
        n = self.max_size
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.block_table = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.replays: dict[int, Replay] = {}
        self.num_replays = 0  # steps served by a graph (the GPU check reads it)

    def capture(self) -> None:
        """Record every size, largest first (the smaller ones reuse its pool memory). The
        buffers hold padding only, so a capture writes nothing to the KV cache."""
        for size in reversed(self.sizes):
            self.replays[size] = self.backend.capture(functools.partial(self._forward, size))

    def padded_size(self, num_tokens: int) -> int | None:
        """The smallest captured size >= num_tokens; None when none is that large."""
        i = bisect.bisect_left(self.sizes, num_tokens)
        return self.sizes[i] if i < len(self.sizes) else None

    def can_run(self, num_reqs: int, num_tokens: int, max_query_len: int) -> bool:
        """Whether a step is a pure decode that fits a captured size."""
        return (
            bool(self.replays)
            and max_query_len == 1
            and num_tokens == num_reqs
            and num_tokens <= self.max_size
        )

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """The hidden states [n, H] of a decode step that `can_run`, from its padded graph."""
        num_tokens = input_ids.shape[0]
        size = self.padded_size(num_tokens)
        assert size is not None, f"no graph holds {num_tokens} tokens"
        self._fill(input_ids, positions, metadata, size)
        self.num_replays += 1
        return self.replays[size]()[:num_tokens]

    def _fill(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        size: int,
    ) -> None:
        n = input_ids.shape[0]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(metadata.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(metadata.seq_lens, non_blocking=True)
        # Columns past the step's table keep older ids: never read, being past seq_lens.
        width = metadata.block_table.shape[1]
        self.block_table[:n, :width].copy_(metadata.block_table[:n], non_blocking=True)
        if n < size:
            self.input_ids[n:size].zero_()
            self.positions[n:size].zero_()
            self.slot_mapping[n:size].fill_(-1)
            self.seq_lens[n:size].fill_(1)
            self.block_table[n:size, 0].zero_()

    def _forward(self, size: int) -> torch.Tensor:
        metadata = AttentionMetadata(
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_table=self.block_table[:size],
            slot_mapping=self.slot_mapping[:size],
            max_query_len=1,
            max_seq_len=self.max_seq_len,
        )
        hidden = self.forward(self.input_ids[:size], self.positions[:size], metadata)
        assert hidden is not None, "CUDA graphs need the whole model on one rank"
        return hidden


def cuda_graphs_unsupported(config: EngineConfig, device: torch.device) -> str | None:
    """Why a runner captures no graphs (None: it does)."""
    if device.type != "cuda":
        return "not a CUDA device"
    if config.model.enforce_eager:
        return "--enforce-eager"
    if config.parallel.world_size > 1:
        return "TP x PP > 1 (collectives are not captured)"
    if config.lora.enable_lora:
        return "LoRA (per-token adapter indices are not captured)"
    return None


def capture_decode_graphs(
    config: EngineConfig,
    forward: Forward,
    device: torch.device,
    max_blocks_per_seq: int,
    max_seq_len: int,
) -> DecodeGraphs | None:
    """The model runner's start-up capture (after its KV cache exists); None where every
    step runs eagerly: a CPU, --enforce-eager, TP x PP > 1, LoRA, or no capture size."""
    sched = config.scheduler
    sizes = capture_sizes(
        config.model.cuda_graph_sizes, sched.max_num_seqs, sched.max_num_batched_tokens
    )
    why_not = cuda_graphs_unsupported(config, device) or (None if sizes else "no capture size")
    if why_not is not None:
        logger.info("CUDA graphs: none (%s); every step runs eagerly", why_not)
        return None
    graphs = DecodeGraphs(
        forward, sizes, max_blocks_per_seq, max_seq_len, device, CudaGraphBackend(device)
    )
    start = time.perf_counter()
    free_before = torch.cuda.mem_get_info(device)[0]
    try:
        graphs.capture()
    except RuntimeError as exc:
        raise RuntimeError(
            f"capturing the decode forward as a CUDA graph failed ({exc}); "
            "--enforce-eager runs every step eagerly"
        ) from exc
    torch.cuda.synchronize(device)
    logger.info(
        "CUDA graphs: %d decode sizes (%s) captured in %.1f s, %.0f MiB",
        len(sizes),
        " ".join(map(str, sizes)),
        time.perf_counter() - start,
        (free_before - torch.cuda.mem_get_info(device)[0]) / 2**20,
    )
    return graphs
