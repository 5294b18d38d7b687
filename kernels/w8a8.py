"""W8A8 int8: int8 weights with one scale per output channel, activations quantized to int8
per token at run time (compressed-tensors' `int-quantized` scheme with dynamic per-token input
activations, what llm-compressor's "W8A8" writes and vLLM runs through oneDNN on CPU).

The weight is a `QuantizedTensor("W8A8")`: the same bytes as "I8" (int8 [N, K] as uint8, float32
scales [N]), so the GGUF machinery (row / column slicing for TP, fused shards, the decode
stack's `kvq_linear`) holds it unchanged. Three kernels compute y = x W^T:

    kvq     kernels/csrc/quant_gemm.c's I8 path (what quant_linear runs for few rows):
            activations quantized in blocks of 32, AVX-512 VNNI dot products, each weight
            block read once per 4 rows
    intmm   activations quantized per row (csrc/w8a8.c, one scale per token as the
            checkpoint's scheme says), the int8 x int8 -> int32 GEMM by torch._int_mm
            (oneDNN: AMX-INT8 tiles on a Sapphire Rapids, VNNI before; it reorders the
            weight on every call), then one C pass y = acc * s_token * s_channel (+ bias),
            written in the activations' dtype
    amx     csrc/w8a8.c's fused AMX-INT8 linear (where the CPU has AMX-INT8 and Linux grants
            the tile state, `amx_available`): the weight packed once into TDPBSSD's B tiles
            (at its first call, kept on the weight's storage), then per call one OpenMP pass:
            per-token quantization, int8 tiles, the scale epilogue (the same numbers as intmm)

Which is faster depends on the machine and the row count, so `kernel_for` times them per
weight shape over ROW_LADDER at first use (interleaved, best of ROUNDS, ~0.1 s per shape) and
keeps per rung the fastest; a call takes the first rung >= its rows. quant_linear runs kvq
itself and the two per-token kernels through `linear_intmm`, which reads the same plan.
KVSERVE_W8A8_KERNEL=kvq|intmm|amx forces one (the tests use it to run each against the
reference).
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

KERNELS = ("kvq", "intmm", "amx")
ROW_LADDER = (1, 4, 16, 32, 64, 128, 256, 512)
ROUNDS = 3
# A per-token kernel must beat kvq by this factor to be chosen at a rung (a tie keeps the
# VNNI kernel).
WIN_MARGIN = 1.05
_FORCE_ENV = "KVSERVE_W8A8_KERNEL"

_LIBRARY = NativeLibrary(
    "kvserve_w8a8",
    [Path(__file__).parent / "csrc" / "w8a8.c"],
    (
        "kvw8_quantize_rows",
        "kvw8_scale_rows",
        "kvw8_amx_available",
        "kvw8_amx_pack",
        "kvw8_amx_linear",
        "kvw8_amx_bf16_pack",
        "kvw8_amx_bf16_linear",
    ),
    "W8A8 kernel",
    "W8A8 matmuls use the I8 kernel",
)


def available() -> bool:
    """Whether the per-token int8 path can run here (its C helpers built, torch._int_mm)."""
    return _LIBRARY.load() is not None and hasattr(torch, "_int_mm")


def amx_available() -> bool:
    """Whether the fused AMX-INT8 kernel runs here (built for a CPU with AMX-INT8 and
    AVX512-BF16, and the tile state granted by Linux)."""
    lib = _LIBRARY.load()
    if lib is None:
        return False
    ok = ctypes.c_int(0)
    lib.kvw8_amx_available(ctypes.byref(ok))
    return bool(ok.value)


def amx_linear_address() -> int:
    """kvw8_amx_linear's address, for C callers (the native decode stack)."""
    lib = _LIBRARY.load()
    assert lib is not None
    address = ctypes.cast(lib.kvw8_amx_linear, ctypes.c_void_p).value
    assert address is not None
    return address


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
    x float32 or bfloat16 [M, K]; y in out_dtype (default x's dtype: float32 or bfloat16).
    Runs the fused AMX kernel or torch._int_mm: forced, else the measured plan's rung for
    this shape, else (no plan yet) the AMX kernel where it is available."""
    n, k = weight.shape
    dtype = x.dtype if x.dtype in (torch.float32, torch.bfloat16) else torch.float32
    if _per_token_kernel(x.shape[0], n, k, dtype) == "amx":
        return linear_amx(x, weight, weight_scales, bias, out_dtype)
    return linear_torch_int_mm(x, weight, weight_scales, bias, out_dtype)


def linear_torch_int_mm(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scales: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """linear_intmm by torch._int_mm: per-token quantization and the scale pass in C."""
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


def packed_for_amx(weight: torch.Tensor) -> torch.Tensor:
    """weight int8 [N, K] packed into the AMX kernel's B tiles, once: kept on the weight's
    storage (whose Python object torch keeps while the storage lives, through every view and
    dtype reinterpretation), keyed by the weight's address and shape. The weight must not
    change in place after its first use (kvserve's loaded weights do not)."""
    cache = weight.untyped_storage().__dict__.setdefault("_kvserve_amx_packed", {})
    n, k = weight.shape
    key = (weight.data_ptr(), n, k)
    packed = cache.get(key)
    if packed is None:
        lib = _LIBRARY.load()
        assert lib is not None and weight.dtype == torch.int8
        packed = torch.empty(((n + 31) // 32 * 32) * ((k + 63) // 64 * 64), dtype=torch.int8)
        lib.kvw8_amx_pack(_p(weight.contiguous()), ctypes.c_int(n), ctypes.c_int(k), _p(packed))
        cache[key] = packed
    return packed


def linear_amx(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scales: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """linear_intmm by the fused AMX-INT8 kernel (csrc/w8a8.c `kvw8_amx_linear`)."""
    lib = _LIBRARY.load()
    if lib is None or not amx_available():
        raise RuntimeError("the AMX-INT8 W8A8 kernel needs a CPU with AMX-INT8 and AVX512-BF16")
    if x.stride(1) != 1 or x.dtype not in (torch.float32, torch.bfloat16):
        x = x.float().contiguous()
    out_dtype = out_dtype or x.dtype
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty(m, n, dtype=out_dtype)
    if m == 0:
        return y
    packed = packed_for_amx(weight)
    b = bias.float().contiguous() if bias is not None else None
    status = ctypes.c_int(0)
    lib.kvw8_amx_linear(
        _p(x), ctypes.c_int(x.dtype == torch.bfloat16), ctypes.c_int64(x.stride(0)),
        ctypes.c_int(m), ctypes.c_int(k), _p(packed), ctypes.c_int(n),
        _p(weight_scales.float().contiguous()), _p(b), _p(y),
        ctypes.c_int(out_dtype == torch.bfloat16), ctypes.c_int64(n), ctypes.byref(status),
    )  # fmt: skip
    if status.value != 0:
        raise RuntimeError(f"kvw8_amx_linear failed (status {status.value})")
    return y


def packed_for_amx_bf16(weight: torch.Tensor) -> torch.Tensor:
    """weight bfloat16 [N, K] packed into kvw8_amx_bf16_linear's B tiles, once (kept on the
    weight's storage as packed_for_amx keeps the int8 packing)."""
    cache = weight.untyped_storage().__dict__.setdefault("_kvserve_amx_bf16_packed", {})
    n, k = weight.shape
    key = (weight.data_ptr(), n, k)
    packed = cache.get(key)
    if packed is None:
        lib = _LIBRARY.load()
        assert lib is not None and weight.dtype == torch.bfloat16
        packed = torch.empty(((n + 31) // 32 * 32) * ((k + 31) // 32 * 32), dtype=torch.bfloat16)
        lib.kvw8_amx_bf16_pack(
            _p(weight.contiguous()), ctypes.c_int(n), ctypes.c_int(k), _p(packed)
        )
        cache[key] = packed
    return packed


def linear_amx_bf16(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """y = x W^T in bfloat16 (float32 sums, one fixed order per output whatever the row count)
    by csrc/w8a8.c's AMX-BF16 kernel: x and weight bfloat16, the weight packed once. What the
    native decode stack's LM head runs where amx_available()."""
    lib = _LIBRARY.load()
    if lib is None or not amx_available():
        raise RuntimeError("the AMX-BF16 linear needs a CPU with AMX (and AVX512-BF16)")
    assert x.dtype == weight.dtype == torch.bfloat16
    lead = x.shape[:-1]
    x = x.reshape(-1, x.shape[-1])
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty(m, n, dtype=torch.bfloat16)
    if m > 0:
        packed = packed_for_amx_bf16(weight)
        status = ctypes.c_int(0)
        lib.kvw8_amx_bf16_linear(
            _p(x), ctypes.c_int64(x.stride(0)), ctypes.c_int(m), ctypes.c_int(k), _p(packed),
            ctypes.c_int(n), _p(y), ctypes.c_int(1), ctypes.c_int64(n), ctypes.byref(status),
        )  # fmt: skip
        if status.value != 0:
            raise RuntimeError(f"kvw8_amx_bf16_linear failed (status {status.value})")
    return y.view(*lead, n)


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
# While a plan is measured, the per-token kernel linear_intmm must run (this thread only).
_measuring = threading.local()


def forced() -> str | None:
    value = os.environ.get(_FORCE_ENV) or None
    if value is not None and value not in KERNELS:
        raise ValueError(f"{_FORCE_ENV} must be one of {KERNELS}, got {value!r}")
    return value


def kernel_for(rows: int, n: int, k: int, dtype: torch.dtype, run_kvq, run_intmm) -> str:
    """ "kvq" or "intmm" (the per-token kernels, run by linear_intmm) for `rows` rows of an
    [n, k] weight: forced, else the measured plan's rung (measured on the first call for this
    shape and activation dtype, with run_intmm timed once per per-token kernel)."""
    choice = forced()
    if choice is not None:
        return "kvq" if choice == "kvq" else "intmm"
    if not available():
        return "kvq"
    return "kvq" if _plan_choice(rows, n, k, dtype, run_kvq, run_intmm) == "kvq" else "intmm"


def _plan_choice(rows, n, k, dtype, run_kvq, run_intmm) -> str:
    key = (n, k, dtype)
    plan = _plans.get(key)
    if plan is None:
        with _plans_lock:
            plan = _plans.get(key) or _measure(n, k, dtype, run_kvq, run_intmm)
            _plans[key] = plan
    i = min(bisect.bisect_left(ROW_LADDER, rows), len(ROW_LADDER) - 1)
    return plan[i]


def _per_token_kernel(rows: int, n: int, k: int, dtype: torch.dtype) -> str:
    """ "amx" or "intmm" for linear_intmm: the one being measured, forced, the plan's rung
    (when it names one), else the AMX kernel where available."""
    choice = getattr(_measuring, "kernel", None) or forced()
    if choice == "amx" and not amx_available():
        raise ValueError(f"{_FORCE_ENV}=amx needs a CPU with AMX-INT8 (and AVX512-BF16)")
    if choice in ("amx", "intmm"):
        return choice
    plan = _plans.get((n, k, dtype))
    if plan is not None:
        choice = plan[min(bisect.bisect_left(ROW_LADDER, rows), len(ROW_LADDER) - 1)]
        if choice != "kvq":
            return choice
    return "amx" if amx_available() else "intmm"


def _best(fn, x: torch.Tensor, reps: int) -> float:
    start = time.perf_counter()
    for _ in range(reps):
        fn(x)
    return (time.perf_counter() - start) / reps


def _run_as(kernel: str, run_intmm):
    def run(x):
        _measuring.kernel = kernel
        try:
            return run_intmm(x)
        finally:
            _measuring.kernel = None

    return run


def _measure(n: int, k: int, dtype: torch.dtype, run_kvq, run_intmm) -> tuple[str, ...]:
    """Per rung of ROW_LADDER the fastest kernel on the layer's [n, k] weight, interleaved
    (a per-token kernel must beat kvq by WIN_MARGIN)."""
    start = time.perf_counter()
    gen = torch.Generator().manual_seed(0)
    runs = {"kvq": run_kvq, "intmm": _run_as("intmm", run_intmm)}
    if amx_available():
        runs["amx"] = _run_as("amx", run_intmm)
    choices = []
    for rows in ROW_LADDER:
        x = torch.randn(rows, k, generator=gen).to(dtype)
        reps = max(2, 64 // rows)
        for run in runs.values():  # warm each (the AMX kernel packs its weight here)
            run(x)
        times = dict.fromkeys(runs, float("inf"))
        for _ in range(ROUNDS):
            for name, run in runs.items():
                times[name] = min(times[name], _best(run, x, reps))
        best = min((t, name) for name, t in times.items() if name != "kvq")
        choices.append(best[1] if best[0] * WIN_MARGIN < times["kvq"] else "kvq")
    logger.info(
        "W8A8 plan for %dx%d %s (measured in %.2f s): %s",
        n, k, str(dtype).removeprefix("torch."), time.perf_counter() - start,
        ", ".join(f"{r}:{c}" for r, c in zip(ROW_LADDER, choices, strict=True)),
    )  # fmt: skip
    return tuple(choices)
