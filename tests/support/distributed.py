"""gloo process groups for the worker tests that run two ranks in child processes."""

from __future__ import annotations

import torch
import torch.distributed as dist

from kvserve.services.worker.parallel_state import destroy_model_parallel, initialize_model_parallel


def init_two_ranks(rank: int, store_path: str, tp: int, pp: int = 1) -> None:
    """Join a world of two gloo ranks meeting at a file store, split TP x PP.

    Args:
        rank: this process's rank (what torch.multiprocessing.spawn passes first).
        store_path: a file both ranks can reach; it must not exist yet.
        tp, pp: the tensor- and pipeline-parallel sizes (tp * pp == 2).
    """
    torch.set_num_threads(1)  # two ranks on two cores
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=2)
    initialize_model_parallel(tensor_parallel_size=tp, pipeline_parallel_size=pp)


def leave_two_ranks() -> None:
    """Tear down what init_two_ranks set up (call it in a finally)."""
    destroy_model_parallel()
    dist.destroy_process_group()


def run_two_ranks(fn, args: tuple) -> None:
    """Run fn(rank, *args) in two forked processes, ranks 0 and 1, and wait for both (an
    exception in either fails the call, as torch.multiprocessing.spawn does).

    Forked, not spawned: the ranks inherit the test process's imports (torch, kvserve,
    transformers), where a spawned rank imports them again, a few CPU seconds each, which
    over the worker tests' two-rank cases was a minute of the suite's time. Safe here: the
    tests hold no CUDA context and no process group when they fork, and each rank runs one
    thread (init_two_ranks), so no OpenMP pool of the parent is reused in the child.
    """
    torch.multiprocessing.start_processes(fn, args=args, nprocs=2, start_method="fork")
