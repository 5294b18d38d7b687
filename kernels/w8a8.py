"""W8A8 int8: int8 weights with one scale per output channel, activations quantized to int8
per token at run time (compressed-tensors' `int-quantized` scheme with dynamic per-token input
activations, what llm-compressor's "W8A8" writes and vLLM runs through oneDNN on CPU).

The weight is a `QuantizedTensor("W8A8")`: the same bytes as "I8" (int8 [N, K] as uint8, float32
scales [N]), so the GGUF machinery (row / column slicing for TP, fused shards, the decode
stack's `kvq_linear`) holds it unchanged. Two kernels compute y = x W^T:

    kvq     kernels/csrc/quant_gemm.c's I8 path (what quant_linear runs for few rows):
            activations quantized in blocks of 32, AVX-512 VNNI dot products, each weight
            block read once per 4 rows
    intmm   this module: activations quantized per row (csrc/w8a8.c, one scale per token as
            the checkpoint's scheme says), the int8 x int8 -> int32 GEMM by torch._int_mm
            (oneDNN: AMX-INT8 tiles on a Sapphire Rapids, VNNI before), then one C pass
            y = acc * s_token * s_channel (+ bias), written in the activations' dtype

Which is faster depends on the machine and the row count, so `plan_for` times both per weight
shape over ROW_LADDER at first use (interleaved, best of ROUNDS, ~0.1 s per shape) and keeps
per rung the faster; a call takes the first rung >= its rows. KVSERVE_W8A8_KERNEL=kvq|intmm
forces one (the tests use it to run each against the reference).
"""

from __future__ import annotations

import bisect
import ctypes
import os
import threading
import time
from pathlib import Path

import torch

from kvserve.kernels.cpu import NativeLibrary
from kvserve.shared.logging import init_logger

logger = init_logger(__name__)

KERNELS = ("kvq", "intmm")
ROW_LADDER = (1, 4, 16, 32, 64, 128, 256, 512)
ROUNDS = 3
# intmm must beat kvq by this factor to be chosen at a rung (a tie keeps the VNNI kernel).
WIN_MARGIN = 1.05
_FORCE_ENV = "KVSERVE_W8A8_KERNEL"

_LIBRARY = NativeLibrary(
    "kvserve_w8a8",
    [Path(__file__).parent / "csrc" / "w8a8.c"],
    ("kvw8_quantize_rows", "kvw8_scale_rows"),
    "W8A8 kernel",
    "W8A8 matmuls use the I8 kernel",
)


def available() -> bool:
    """Whether the per-token int8 path can run here (its C helpers built, torch._int_mm)."""
    return _LIBRARY.load() is not None and hasattr(torch, "_int_mm")


def _p(t: torch.Tensor | None) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr() if t is not None else None)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x float32 / bfloat16 [M, K] (rows contiguous) -> (int8 [M, K], float32 scales [M]):
    s = max|x_row| / 127, q = round-half-even(x / s), as vLLM's dynamic per-token quant."""
    lib = _LIBRARY.load()
    assert lib is not None and x.stride(1) == 1 and x.dtype in (torch.float32, torch.bfloat16)
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.int8)
    scales = torch.empty(m)
    lib.kvw8_quantize_rows(
        _p(x), ctypes.c_int(x.dtype == torch.bfloat16), ctypes.c_int64(x.stride(0)),
        ctypes.c_int(m), ctypes.c_int(k), _p(q), _p(scales),
    )  # fmt: skip
    return q, scales


def linear_intmm(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scales: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """y [M, N] = (q_x s_x) (W s_w)^T (+ bias): weight int8 [N, K], weight_scales float32 [N];
    x float32 or bfloat16 [M, K]; y in out_dtype (default x's dtype: float32 or bfloat16)."""
    lib = _LIBRARY.load()
    assert lib is not None
    if x.stride(1) != 1 or x.dtype not in (torch.float32, torch.bfloat16):
        x = x.float().contiguous()
    out_dtype = out_dtype or x.dtype
    q, sx = quantize_per_token(x)
    acc = torch._int_mm(q, weight.t())
    m, n = acc.shape
    y = torch.empty(m, n, dtype=out_dtype)
    b = bias.float().contiguous() if bias is not None else None
    lib.kvw8_scale_rows(
        _p(acc), ctypes.c_int(m), ctypes.c_int(n), _p(sx), _p(weight_scales), _p(b), _p(y),
        ctypes.c_int(out_dtype == torch.bfloat16), ctypes.c_int64(n),
    )  # fmt: skip
    return y


def linear_ref(x: torch.Tensor, weight: torch.Tensor, weight_scales: torch.Tensor, bias=None):
    """The same numbers from torch ops (per-token quantization, exact integer products)."""
    xf = x.float()
    sx = xf.abs().amax(dim=1) / 127.0
    q = torch.round(xf / torch.where(sx > 0, sx, 1.0)[:, None]).clamp(-127, 127)
    acc = q.double() @ weight.double().t()  # exact: |sums| < 2^53
    y = (acc * sx.double()[:, None] * weight_scales.double()[None, :]).float()
    return y + bias.float() if bias is not None else y


# ---------------------------------------------------------------------- the measured plan

_plans: dict[tuple[int, int, torch.dtype], tuple[str, ...]] = {}
_plans_lock = threading.Lock()


def forced() -> str | None:
    value = os.environ.get(_FORCE_ENV) or None
    if value is not None and value not in KERNELS:
        raise ValueError(f"{_FORCE_ENV} must be one of {KERNELS}, got {value!r}")
    return value


def kernel_for(rows: int, n: int, k: int, dtype: torch.dtype, run_kvq, run_intmm) -> str:
    """The kernel for `rows` rows of an [n, k] weight: forced, else the measured plan's rung
    (measured on the first call for this shape and activation dtype)."""
    choice = forced()
    if choice is not None:
        return choice
    if not available():
        return "kvq"
    key = (n, k, dtype)
    plan = _plans.get(key)
    if plan is None:
        with _plans_lock:
            plan = _plans.get(key) or _measure(n, k, dtype, run_kvq, run_intmm)
            _plans[key] = plan
    i = min(bisect.bisect_left(ROW_LADDER, rows), len(ROW_LADDER) - 1)
    return plan[i]


def _best(fn, x: torch.Tensor, reps: int) -> float:
    start = time.perf_counter()
    for _ in range(reps):
        fn(x)
    return (time.perf_counter() - start) / reps


def _measure(n: int, k: int, dtype: torch.dtype, run_kvq, run_intmm) -> tuple[str, ...]:
    """Per rung of ROW_LADDER the faster kernel on a random [n, k] weight, interleaved."""
    start = time.perf_counter()
    gen = torch.Generator().manual_seed(0)
    choices = []
    for rows in ROW_LADDER:
        x = torch.randn(rows, k, generator=gen).to(dtype)
        reps = max(2, 64 // rows)
        run_kvq(x), run_intmm(x)  # warm both
        kvq_t, intmm_t = float("inf"), float("inf")
        for _ in range(ROUNDS):
            kvq_t = min(kvq_t, _best(run_kvq, x, reps))
            intmm_t = min(intmm_t, _best(run_intmm, x, reps))
        choices.append("intmm" if intmm_t * WIN_MARGIN < kvq_t else "kvq")
    logger.info(
        "W8A8 plan for %dx%d %s (measured in %.2f s): %s",
        n, k, str(dtype).removeprefix("torch."), time.perf_counter() - start,
        ", ".join(f"{r}:{c}" for r, c in zip(ROW_LADDER, choices, strict=True)),
    )  # fmt: skip
    return tuple(choices)
