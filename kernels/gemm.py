"""CPU GEMM paths for the linear layers, chosen by measuring on this machine.

Four paths compute y = x W^T (+ b) for a weight W [N, K]:

    torch   F.linear: MKL's sgemm / bf16 GEMM on x86 (what PyTorch picks)
    onednn  oneDNN's inner product with W reordered once into its blocked layout
            (torch.ops.mkldnn._linear_pointwise over _reorder_linear_weight), the path
            vLLM-CPU and torch.compile's CPU backend use
    native  the decode stack's GEMV (csrc/decode_stack.c): W read once per call whatever
            the row count, inputs four at a time (with AVX-512 against six W rows a tile);
            bfloat16 widened in registers, so it runs
            where oneDNN's bfloat16 cannot (an AVX2-only CPU, where torch's bfloat16 GEMM
            is a slow generic loop)
    widened bfloat16 only: W kept in bfloat16 (half the bytes held and read), widened to
            float32 into a reused scratch buffer at each call, x widened too, MKL's sgemm,
            the result rounded once to bfloat16. On a CPU without a bfloat16 dot product
            (no AVX512-BF16, no AMX) oneDNN's bfloat16 GEMM emulates one and ran 4-8x
            slower than float32 at 256-2048 rows (bench/RESULTS.md); widening a weight
            costs one pass over it, a few percent of a GEMM of 256 rows or more

Which is faster depends on the CPU, the dtype, the weight's shape and the number of rows
(on an AMD EPYC VM oneDNN ran float32 1.1-4x faster than MKL, bench/RESULTS.md; elsewhere
MKL may win small row counts). So nothing is assumed: `tune` times both paths for every
(dtype, N, K) of the model over a ladder of row counts, interleaved, and keeps per rung the
faster one by its fastest call (torch unless oneDNN wins by a margin). The plan is cached
per machine (CPU model and flags, torch version, threads) in $KVSERVE_CACHE_DIR/gemm/, so
a second start reuses it, unless other work held the cores while it was measured: a shape
measured while tasks waited for a core more than CONTENDED_SHARE of the time (Linux's
/proc/pressure/cpu) is measured again after SETTLE_S, up to SETTLE_BUDGET_S of waiting in
all (the engine's own processes start beside the worker's tuning: on two cores the api's
imports alone made every start contended, so no plan was ever cached and every start ran
torch's slower path); a shape still contended then serves that start only, uncached, and
measuring stops, so a start beside other busy engines is not minutes long. The shapes left
take the plan of a same-dtype shape measured on quiet cores (this start or cached), else
torch's path. (A plan measured under load once picked MKL for half the bfloat16 shapes that
oneDNN runs 1.3x faster on a quiet machine, and kept it.)

A layer holds a `LinearWeights` (its packed copy and the plan for its shape); `linear`
picks the rung of the call's row count.
"""

from __future__ import annotations

import bisect
import ctypes
import functools
import hashlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvserve.kernels.cpu import cpu_has_bf16_dot, cpu_identity
from kvserve.shared.env import CACHE_DIR
from kvserve.shared.logging import init_logger

logger = init_logger(__name__)

PATHS = ("torch", "onednn", "native", "widened")
# Row counts the plan is measured at; a call takes the first rung >= its rows (the last
# rung's choice beyond it).
ROW_LADDER = (1, 4, 16, 64, 256, 1024)
# Another path must beat torch by this factor to be chosen: a tie keeps PyTorch's own path.
WIN_MARGIN = 1.05
# A path this many times slower than the fastest at a rung is not timed at the larger ones.
DROP_FACTOR = 3.0
# A measurement during which some task waited for a CPU more than this share of the time
# was contended: it is used, not cached.
CONTENDED_SHARE = 0.05
# A contended shape is measured again after this wait, while the waits add up to at most
# SETTLE_BUDGET_S over the whole plan.
SETTLE_S = 0.5
SETTLE_BUDGET_S = 4.0
# The cache file's format and measuring method; a new one re-measures every machine.
CACHE_VERSION = 4
_PSI_CPU = "/proc/pressure/cpu"
DTYPES = (torch.float32, torch.bfloat16)


def onednn_available(dtype: torch.dtype = torch.float32) -> bool:
    """oneDNN's packed linear runs `dtype` here: bfloat16 needs AVX-512 (BW, VL, DQ) or
    AVX-NE-CONVERT, which an AVX2-only CPU (AMD Zen 3, say) lacks."""
    if not (
        torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    ):
        return False
    return dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()


def native_available(dtype: torch.dtype) -> bool:
    """The native GEMV is built here and handles `dtype`."""
    from kvserve.kernels import cpu

    return dtype in cpu.DTYPES and cpu.library() is not None


def widened_available(dtype: torch.dtype) -> bool:
    """The widened path computes bfloat16 layers (float32 ones are torch's own path)."""
    return dtype == torch.bfloat16


def path_available(path: str, dtype: torch.dtype) -> bool:
    if path == "onednn":
        return onednn_available(dtype)
    if path == "native":
        return native_available(dtype)
    if path == "widened":
        return widened_available(dtype)
    return True


def unmeasured_plan(dtype: torch.dtype) -> ShapePlan:
    """The plan of a shape left unmeasured (the cores proved contended): torch's path, except
    bfloat16 on a CPU without a bfloat16 dot product, where torch's emulated bfloat16 GEMM is
    the slowest path from 16 rows on (bench/RESULTS.md): the widened one runs there."""
    if dtype != torch.bfloat16 or cpu_has_bf16_dot():
        return ShapePlan(("torch",) * len(ROW_LADDER))
    return ShapePlan(tuple("torch" if rows < 16 else "widened" for rows in ROW_LADDER))


def native_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """y = x W^T (+ b) by the native GEMV. x [M, K] and W [N, K] of one dtype."""
    from kvserve.kernels import cpu

    lib = cpu.library()
    assert lib is not None and weight.is_contiguous() and x.dtype == weight.dtype
    lead = x.shape[:-1]
    x = x.reshape(-1, x.shape[-1]).contiguous()
    rows, (n, k) = x.shape[0], weight.shape
    y = torch.empty(rows, n, dtype=x.dtype)
    bias32 = None if bias is None else bias.float().contiguous()
    fn = lib.small_linear_f32 if x.dtype == torch.float32 else lib.small_linear_bf16
    fn(
        ctypes.c_void_p(y.data_ptr()),
        ctypes.c_void_p(x.data_ptr()),
        ctypes.c_void_p(weight.data_ptr()),
        None if bias32 is None else ctypes.c_void_p(bias32.data_ptr()),
        ctypes.c_int(rows),
        ctypes.c_int(n),
        ctypes.c_int(k),
    )
    return y.view(*lead, n)


# Per thread: the float32 copy of the weight being multiplied. It stays held, as large as the
# largest weight widened (4 bytes a weight: the default model's MLP, 7 MB).
_SCRATCH = threading.local()


def _widened_weight(weight: torch.Tensor) -> torch.Tensor:
    """W widened to float32 in this thread's scratch buffer (grown to the largest weight
    widened, then reused: no allocation, no page faults per call)."""
    buf = getattr(_SCRATCH, "buf", None)
    if buf is None or buf.numel() < weight.numel():
        buf = _SCRATCH.buf = torch.empty(weight.numel(), dtype=torch.float32)
    return buf[: weight.numel()].view(weight.shape).copy_(weight)


def widened_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """y = x W^T (+ b) for bfloat16 x and W, computed in float32 (MKL's sgemm): every product
    of two bfloat16 values is exact in float32 and the sum is float32, as in oneDNN's
    bfloat16 GEMM; the result is rounded to bfloat16 once."""
    w32 = _widened_weight(weight)
    y = F.linear(x.float(), w32, None if bias is None else bias.float())
    return y.to(x.dtype)


def pack_onednn(weight: torch.Tensor, rows_hint: int = 64) -> torch.Tensor:
    """W reordered into oneDNN's blocked layout (an opaque mkldnn tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows_hint)


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None):
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@dataclass(frozen=True)
class ShapePlan:
    """The path per rung of ROW_LADDER for one (dtype, N, K)."""

    paths: tuple[str, ...]

    def path_for(self, num_rows: int) -> str:
        rung = min(bisect.bisect_left(ROW_LADDER, num_rows), len(ROW_LADDER) - 1)
        return self.paths[rung]

    def describe(self) -> str:
        """'torch' / 'onednn' / 'native', or 'native from 1, onednn from 16' for a split
        plan."""
        if len(set(self.paths)) == 1:
            return self.paths[0]
        parts, last = [], None
        for rows, path in zip(ROW_LADDER, self.paths):
            if path != last:
                parts.append(f"{path} from {rows}")
                last = path
        return ", ".join(parts)


@dataclass
class LinearWeights:
    """What `linear` needs beyond the weight itself: its oneDNN copy and its plan."""

    plan: ShapePlan
    packed: torch.Tensor | None = None


def adds_in_place_of_output(prepared: LinearWeights | None, num_rows: int) -> bool:
    """Whether `linear` with an `add` of num_rows rows fuses the add into the GEMM: oneDNN's
    binary-add post-op, applied to the finished float32 accumulator (in float32 exactly the
    unfused sum; in bfloat16 one rounding fewer). The other paths add afterwards."""
    return (
        prepared is not None
        and prepared.packed is not None
        and prepared.plan.path_for(num_rows) == "onednn"
    )


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    prepared: LinearWeights | None,
    add: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = x W^T + b (+ add, [T, N]) on the path the plan names for x's row count. x: [T, K]."""
    if add is not None:
        if adds_in_place_of_output(prepared, x.shape[0]):
            assert prepared is not None and prepared.packed is not None
            return torch.ops.mkldnn._linear_pointwise.binary(
                x if x.is_contiguous() else x.contiguous(),
                add if add.is_contiguous() else add.contiguous(),
                prepared.packed,
                bias,
                "add",
            )
        return linear(x, weight, bias, prepared) + add
    if prepared is None:
        return F.linear(x, weight, bias)
    path = prepared.plan.path_for(x.shape[0])
    if path == "onednn" and prepared.packed is not None:
        return onednn_linear(x if x.is_contiguous() else x.contiguous(), prepared.packed, bias)
    if path == "native":
        return native_linear(x, weight, bias)
    if path == "widened":
        return widened_linear(x, weight, bias)
    return F.linear(x, weight, bias)


# ---------------------------------------------------------------------- measuring


@dataclass
class GemmPlan:
    """Shape plans by 'dtype:NxK', and how they were obtained."""

    shapes: dict[str, ShapePlan] = field(default_factory=dict)
    source: str = "measured"  # measured | cached | forced
    seconds: float = 0.0
    stalled_share: float | None = None  # of the measuring time some task waited for a CPU
    # Shapes left unmeasured (_fallback_plan): measuring stopped once the cores stayed
    # contended past SETTLE_BUDGET_S.
    unmeasured: int = 0
    contended: int = 0  # shapes measured on contended cores: serving this start, uncached

    @staticmethod
    def key(dtype: torch.dtype, n: int, k: int) -> str:
        return f"{str(dtype).removeprefix('torch.')}:{n}x{k}"

    def for_weight(self, weight: torch.Tensor) -> ShapePlan | None:
        return self.shapes.get(self.key(weight.dtype, *weight.shape))

    def summary(self) -> dict[str, str]:
        """'float32:960x576' -> 'onednn' (the start-up log and the info metric)."""
        return {key: plan.describe() for key, plan in sorted(self.shapes.items())}


def _time_calls(fn: Callable[[], object], min_seconds: float, max_calls: int) -> float:
    """The fastest call of fn, after a warm-up call. The minimum, not the median: another
    process on the cores (a loaded machine at start-up) only ever adds time, and a plan is
    measured once and then cached."""
    fn()
    samples: list[float] = []
    deadline = time.perf_counter() + min_seconds
    while len(samples) < 3 or (time.perf_counter() < deadline and len(samples) < max_calls):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return min(samples)


def measure_shape(
    dtype: torch.dtype, n: int, k: int, max_rows: int, seconds_per_rung: float = 0.04
) -> ShapePlan:
    """Time every path that runs `dtype` here at each rung up to max_rows, interleaved
    (A B C A B C) against drift; keep the fastest, torch unless another beats it by
    WIN_MARGIN."""
    weight = torch.randn(n, k, dtype=dtype) / k**0.5
    calls: dict[str, Callable[[torch.Tensor], object]] = {"torch": lambda x: F.linear(x, weight)}
    if onednn_available(dtype):
        packed = pack_onednn(weight)
        calls["onednn"] = lambda x: onednn_linear(x, packed, None)
    if native_available(dtype):
        calls["native"] = lambda x: native_linear(x, weight, None)
    if widened_available(dtype):
        calls["widened"] = lambda x: widened_linear(x, weight, None)
    paths: list[str] = []
    for rows in ROW_LADDER:
        if rows > max_rows and paths:
            paths.append(paths[-1])
            continue
        x = torch.randn(rows, k, dtype=dtype)
        times: dict[str, list[float]] = {path: [] for path in calls}
        for _ in range(3):
            for path, call in calls.items():
                budget = seconds_per_rung / (2 * len(calls))
                times[path].append(_time_calls(functools.partial(call, x), budget, 50))
        best = {path: min(t) for path, t in times.items()}
        fastest = min(best, key=lambda path: best[path])
        faster = "torch" not in best or best["torch"] > WIN_MARGIN * best[fastest]
        paths.append(fastest if faster else "torch")
        # A path DROP_FACTOR times slower than the fastest is not timed at larger rungs
        # (torch's bfloat16 on an AVX2 CPU: a second per 1024-row call), nor chosen there.
        calls = {
            path: call for path, call in calls.items() if best[path] <= DROP_FACTOR * best[fastest]
        }
    return ShapePlan(tuple(paths))


def machine_key(num_threads: int) -> str:
    """What a cached plan is valid for: CPU model and ISA flags, torch, thread count, and the
    native kernels' build (a changed GEMV is measured again)."""
    from kvserve.kernels import cpu

    text = f"{cpu_identity()}|{torch.__version__}|{num_threads}|{cpu.library_file()}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _cache_path(num_threads: int) -> str:
    name = f"plan-v{CACHE_VERSION}-{machine_key(num_threads)}.json"
    return os.path.join(CACHE_DIR.get(), "gemm", name)


def cpu_stall_us() -> int | None:
    """Microseconds, since boot, during which some task waited for a CPU (the "some" line of
    Linux's pressure stall information), or None where the kernel has no PSI."""
    try:
        with open(_PSI_CPU) as f:
            some = f.readline().split()
    except OSError:
        return None
    fields = dict(item.split("=", 1) for item in some[1:] if "=" in item)
    return int(fields["total"]) if "total" in fields else None


def tune(
    shapes: Iterable[tuple[torch.dtype, int, int, int]],
    *,
    mode: str = "auto",
    use_cache: bool = True,
    measure: Callable[[torch.dtype, int, int, int], ShapePlan] = measure_shape,
) -> GemmPlan:
    """The plan for every (dtype, N, K, max_rows) given.

    Args:
        mode: auto (measure, or reuse this machine's cached measurements), torch, onednn,
            native or widened (forced, no measuring; a dtype the forced path cannot run stays on
            torch).
        use_cache: read and extend the on-disk plan cache (auto only).
        measure: times one shape (tests pass a fake).
    """
    shapes = sorted(set(shapes), key=lambda s: (str(s[0]), s[1], s[2], s[3]))
    if mode not in (*PATHS, "auto"):
        raise ValueError(f"unknown GEMM path {mode!r}: use auto, torch, onednn, native or widened")
    if mode in PATHS:
        return _forced_plan(shapes, mode)
    torch_only = ShapePlan(("torch",) * len(ROW_LADDER))
    if not any(_measurable(d) for d, _, _, _ in shapes):
        return GemmPlan({GemmPlan.key(d, n, k): torch_only for d, n, k, _ in shapes}, "forced")
    path = _cache_path(torch.get_num_threads())
    cached = _read_cache(path) if use_cache else {}
    plan = GemmPlan(source="cached")
    quiet: dict[str, ShapePlan] = {}  # measured on quiet cores: cached
    clock = _MeasuringClock()
    left = []
    for dtype, n, k, max_rows in shapes:
        key = GemmPlan.key(dtype, n, k)
        cache_key = f"{key}:{max_rows}"
        if cache_key in cached:
            plan.shapes[key] = cached[cache_key]
        elif not _measurable(dtype):
            plan.shapes[key] = torch_only
        elif plan.contended:  # the cores stayed contended: measuring stopped
            left.append((dtype, key))
        else:
            plan.source = "measured"
            plan.shapes[key], was_quiet = clock.measure(measure, dtype, n, k, max_rows)
            if was_quiet:
                quiet[cache_key] = plan.shapes[key]
            else:
                plan.contended += 1
    for dtype, key in left:
        plan.unmeasured += 1
        plan.shapes[key] = _fallback_plan(dtype, key, {**cached, **quiet})
    plan.seconds = clock.seconds()
    if plan.source == "measured":
        plan.stalled_share = clock.stalled_share()
    if use_cache and quiet:
        _write_cache(path, {**cached, **quiet})
    if plan.contended:
        logger.warning(
            "CPU GEMM plan: %d shapes measured while other work held the cores (a task waited "
            "for a CPU %.0f%% of the time, after %.1f s of waiting for them to settle): used "
            "for this start, not cached; %d shapes left unmeasured take a quiet same-dtype "
            "shape's plan, else torch's (widened where the CPU emulates bfloat16)",
            plan.contended,
            100 * (clock.last_share or 0.0),
            clock.waited_s,
            plan.unmeasured,
        )
    return plan


class _MeasuringClock:
    """Times the measuring and the cores' contention (Linux's pressure stall information)
    during each shape's measurement; re-measures a contended shape after SETTLE_S while the
    waits stay within SETTLE_BUDGET_S."""

    def __init__(self) -> None:
        self.start, self.stall_start = time.perf_counter(), cpu_stall_us()
        self.waited_s = 0.0
        self.last_share: float | None = None

    def measure(
        self,
        measure: Callable[[torch.dtype, int, int, int], ShapePlan],
        dtype: torch.dtype,
        n: int,
        k: int,
        max_rows: int,
    ) -> tuple[ShapePlan, bool]:
        """The shape's plan, and whether it was measured on quiet cores."""
        while True:
            start, stall = time.perf_counter(), cpu_stall_us()
            result = measure(dtype, n, k, max_rows)
            self.last_share = _share(stall, start)
            if self.last_share is None or self.last_share <= CONTENDED_SHARE:
                return result, True
            if self.waited_s + SETTLE_S > SETTLE_BUDGET_S:
                return result, False
            time.sleep(SETTLE_S)
            self.waited_s += SETTLE_S

    def seconds(self) -> float:
        return time.perf_counter() - self.start

    def stalled_share(self) -> float | None:
        """Of the whole measuring time (waits included), the share some task waited for a CPU."""
        return _share(self.stall_start, self.start)


def _share(stall_start: int | None, start: float) -> float | None:
    stall_now, seconds = cpu_stall_us(), time.perf_counter() - start
    if stall_start is None or stall_now is None or seconds <= 0:
        return None
    return min(1.0, (stall_now - stall_start) / 1e6 / seconds)


def _fallback_plan(dtype: torch.dtype, key: str, quiet: dict[str, ShapePlan]) -> ShapePlan:
    """The plan of a shape left unmeasured: that of the same-dtype shape measured on quiet
    cores nearest in size (N x K), else unmeasured_plan."""
    name, size = key.split(":")
    n, k = map(int, size.split("x"))
    same = []
    for other, shape_plan in quiet.items():
        other_name, other_size = other.split(":")[:2]
        if other_name == name:
            on, ok = map(int, other_size.split("x"))
            same.append((abs(on * ok - n * k), other, shape_plan))
    return min(same, key=lambda item: (item[0], item[1]))[2] if same else unmeasured_plan(dtype)


def _forced_plan(shapes: list[tuple[torch.dtype, int, int, int]], mode: str) -> GemmPlan:
    """Every shape on the forced path; a dtype the forced path cannot run on this CPU stays on
    torch."""
    torch_only = ShapePlan(("torch",) * len(ROW_LADDER))
    forced = ShapePlan((mode,) * len(ROW_LADDER))
    return GemmPlan(
        {
            GemmPlan.key(d, n, k): forced if path_available(mode, d) else torch_only
            for d, n, k, _ in shapes
        },
        "forced",
    )


def _measurable(dtype: torch.dtype) -> bool:
    """Whether some path besides torch runs this dtype here."""
    return any(path_available(path, dtype) for path in PATHS if path != "torch")


def _read_cache(path: str) -> dict[str, ShapePlan]:
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, ValueError):
        return {}
    return {
        key: ShapePlan(tuple(paths))
        for key, paths in raw.items()
        if len(paths) == len(ROW_LADDER) and set(paths) <= set(PATHS)
    }


def _write_cache(path: str, plans: dict[str, ShapePlan]) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({key: list(plan.paths) for key, plan in plans.items()}, f, indent=1)
    os.replace(tmp, path)  # atomic: concurrent engines never read half a file
