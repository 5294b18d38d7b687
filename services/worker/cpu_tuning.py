"""CPU tuning at start-up: the GEMM path of every linear layer (kernels/gemm.py) and, once the
KV cache is bound, the prefill attention route (kernels/prefill_route.py), each logged."""

from __future__ import annotations

import time

import torch

from kvserve.kernels import cpu, cpu_prefill, gemm, prefill_route
from kvserve.services.worker.layers.attention import Attention
from kvserve.services.worker.layers.embed_head import ParallelLMHead
from kvserve.services.worker.layers.linear import LinearBase
from kvserve.shared import env
from kvserve.shared.config import EngineConfig
from kvserve.shared.logging import init_logger

logger = init_logger(__name__)


def prepare_gemm(model: torch.nn.Module, config: EngineConfig) -> gemm.GemmPlan:
    """Measure (or reuse) the CPU GEMM plan of every linear layer and the LM head, and
    give each layer whose plan leaves torch its plan (and oneDNN's packed weight where
    the plan uses oneDNN)."""
    sched = config.scheduler
    layers = [
        (
            m,
            sched.max_num_seqs if isinstance(m, ParallelLMHead) else sched.max_num_batched_tokens,
        )
        for m in model.modules()
        if isinstance(m, LinearBase | ParallelLMHead)
        and m.weight.is_floating_point()  # weights held quantized have their own kernels
    ]
    mode = config.model.cpu_gemm
    if mode == "auto" and not env.CPU_GEMM_MEASURE.get():
        mode = "torch"  # KVSERVE_CPU_GEMM_MEASURE=0: no timing at start-up
    plan = gemm.tune(
        ((m.weight.dtype, *m.weight.shape, max_rows) for m, max_rows in layers), mode=mode
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
        if plan.contended:
            how += f", {plan.contended} shapes measured on contended cores (not cached)"
        if plan.unmeasured:
            how += f", {plan.unmeasured} shapes left unmeasured"
    logger.info(
        "CPU GEMM plan (%s, %d threads, %s): %s",
        how,
        torch.get_num_threads(),
        cpu.cpu_isa(),
        ", ".join(f"{k} {v}" for k, v in plan.summary().items()),
    )
    return plan


def measure_prefill_route(dtype: torch.dtype, layer: Attention, block_size: int) -> None:
    """Which prefill chunks take the decode kernel and which torch's flash attention, timed
    on this CPU for this model's head layout (kernels/prefill_route.py)."""
    start = time.perf_counter()
    limit, timings = prefill_route.measure_prefill_route(
        dtype, layer.num_heads, layer.num_kv_heads, layer.head_size, block_size
    )
    flash = cpu_prefill.FLASH_ROUTE.get(
        (dtype, layer.num_heads, layer.num_kv_heads, layer.head_size), "flash"
    )
    logger.info(
        "prefill attention route (measured in %.2f s): %s chunks of up to %d tokens through "
        "the decode kernel, longer through %s (first chunk, decode kernel / flash: %s)",
        time.perf_counter() - start,
        str(dtype).removeprefix("torch."),
        limit,
        flash,
        ", ".join(f"{n}: {d:.2f} / {f:.2f} ms" for n, (d, f) in timings.items()),
    )
