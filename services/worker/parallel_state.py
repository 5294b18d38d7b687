"""Tensor- and pipeline-parallel state of this worker process.

Ranks are laid out TP-major: with TP = 2 and PP = 2 the four global ranks are

    global rank:  0  1  2  3
    pp rank:      0  0  1  1
    tp rank:      0  1  0  1

Before `initialize_model_parallel` (or without torch.distributed) every getter reports a single
rank, and the collectives are no-ops, so one-process code never touches torch.distributed.
The rank and size are cached as ints because layers read them on every forward.

The driver rank, TP rank 0 of the last stage (global rank 2 above), samples and answers the
engine core; every other rank takes its sampled ids from `broadcast_from_driver`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_TP_GROUP: dist.ProcessGroup | None = None
_PP_GROUP: dist.ProcessGroup | None = None
_TP_RANK = 0
_TP_SIZE = 1
_PP_RANK = 0
_PP_SIZE = 1
_WORLD_RANK = 0


def init_distributed_environment(
    world_size: int, rank: int, init_method: str, backend: str
) -> None:
    """Join the world process group (every rank calls this with the same init_method).

    Args:
        world_size: TP x PP.
        rank: this process's global rank.
        init_method: the rendezvous, e.g. tcp://127.0.0.1:29501.
        backend: gloo (CPU) or nccl (CUDA).
    """
    dist.init_process_group(backend, init_method=init_method, world_size=world_size, rank=rank)


def destroy_distributed_environment() -> None:
    """Forget the model-parallel groups and leave the world group (shutdown)."""
    destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def initialize_model_parallel(
    tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1
) -> None:
    """Build the TP and PP process groups; every rank of the world must call this.

    Args:
        tensor_parallel_size: ranks that split each layer's weights.
        pipeline_parallel_size: stages that split the layers.
    """
    global _TP_GROUP, _PP_GROUP, _TP_RANK, _TP_SIZE, _PP_RANK, _PP_SIZE, _WORLD_RANK
    tp, pp = tensor_parallel_size, pipeline_parallel_size
    if not dist.is_initialized():
        if tp * pp != 1:
            raise ValueError(
                f"TP={tp} x PP={pp} needs torch.distributed to be initialized "
                "first (dist.init_process_group)"
            )
        return
    world_size, rank = dist.get_world_size(), dist.get_rank()
    if world_size != tp * pp:
        raise ValueError(f"world size {world_size} != TP {tp} x PP {pp}")
    # new_group is collective: every rank creates every group, in the same order.
    for pp_rank in range(pp):
        ranks = list(range(pp_rank * tp, (pp_rank + 1) * tp))
        group = dist.new_group(ranks)
        if rank in ranks:
            _TP_GROUP, _TP_RANK, _PP_RANK = group, ranks.index(rank), pp_rank
    for tp_rank in range(tp):
        ranks = list(range(tp_rank, world_size, tp))
        group = dist.new_group(ranks)
        if rank in ranks:
            _PP_GROUP = group
    _TP_SIZE, _PP_SIZE, _WORLD_RANK = tp, pp, rank


def destroy_model_parallel() -> None:
    """Forget the groups (tests, shutdown); the getters report a single rank again."""
    global _TP_GROUP, _PP_GROUP, _TP_RANK, _TP_SIZE, _PP_RANK, _PP_SIZE, _WORLD_RANK
    _TP_GROUP = _PP_GROUP = None
    _TP_RANK, _TP_SIZE, _PP_RANK, _PP_SIZE, _WORLD_RANK = 0, 1, 0, 1, 0


def get_tp_rank() -> int:
    return _TP_RANK


def get_tp_size() -> int:
    return _TP_SIZE


def get_pp_rank() -> int:
    return _PP_RANK


def get_pp_size() -> int:
    return _PP_SIZE


def is_first_pp_rank() -> bool:
    return _PP_RANK == 0


def is_last_pp_rank() -> bool:
    return _PP_RANK == _PP_SIZE - 1


def driver_rank(tensor_parallel_size: int, pipeline_parallel_size: int) -> int:
    """Global rank that samples and answers the engine core: TP rank 0 of the last stage."""
    return (pipeline_parallel_size - 1) * tensor_parallel_size


def is_driver() -> bool:
    return _WORLD_RANK == driver_rank(_TP_SIZE, _PP_SIZE)


def pp_layer_range(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """[start, end) of the decoder layers stage pp_rank holds; earlier stages take the
    remainder (30 layers over 4 stages: 8, 8, 7, 7), as the first stage's embedding is
    cheap next to a layer.
    """
    if num_layers < pp_size:
        raise ValueError(
            f"the model has {num_layers} layers, fewer than the "
            f"{pp_size} pipeline stages asked for; lower --pipeline-parallel-size"
        )
    base, remainder = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, remainder)
    return start, start + base + (pp_rank < remainder)


def get_tp_group() -> dist.ProcessGroup | None:
    return _TP_GROUP


def get_pp_group() -> dist.ProcessGroup | None:
    return _PP_GROUP


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum x over the TP group, in place; x itself when TP = 1."""
    if _TP_SIZE == 1:
        return x
    dist.all_reduce(x, group=_TP_GROUP)
    return x


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every TP rank's x along dim (rank order); x itself when TP = 1."""
    if _TP_SIZE == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_TP_SIZE)]
    dist.all_gather(parts, x.contiguous(), group=_TP_GROUP)
    return torch.cat(parts, dim=dim)


def send_to_next_stage(x: torch.Tensor) -> None:
    """Send x to the same TP rank of the next pipeline stage (blocking)."""
    assert _PP_RANK < _PP_SIZE - 1, "the last stage has no next stage"
    dist.send(x.contiguous(), dst=_WORLD_RANK + _TP_SIZE)


def recv_from_prev_stage(out: torch.Tensor) -> torch.Tensor:
    """Fill out (whose shape the receiver knows) from the previous stage's same TP rank."""
    assert _PP_RANK > 0, "the first stage has no previous stage"
    dist.recv(out, src=_WORLD_RANK - _TP_SIZE)
    return out


def broadcast_from_driver(x: torch.Tensor) -> torch.Tensor:
    """Overwrite x on every rank with the driver's x (in place); x itself on one rank."""
    if _TP_SIZE * _PP_SIZE == 1:
        return x
    dist.broadcast(x, src=driver_rank(_TP_SIZE, _PP_SIZE))
    return x
