"""Native CPU kernels: small C sources compiled at first use, called through ctypes.

- Decode attention: the torch reference gathers paged K/V into padded copies, which costs more
  than the attention itself on CPU; the C kernel reads K/V in place through the block table.
- RMSNorm (+ residual add), SiLU-and-mul, rotary: one pass per row instead of the references'
  chains of casts and elementwise ops (each its own OpenMP fork/join on two cores).

They are built once per machine into the kvserve cache folder (`cc -O3 -march=native -fopenmp
-fno-math-errno`, about two seconds) and share torch's OpenMP runtime. Without a C compiler,
callers fall back to the torch references (`available()` is False).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, overload

import torch

from kvserve.shared.env import CACHE_DIR
from kvserve.shared.logging import init_logger

logger = init_logger(__name__)

_SOURCES = [
    Path(__file__).parent / "csrc" / name
    for name in ("decode_attention.c", "cpu_ops.c", "decode_stack.c", "prefill_attention_amx.c")
]
_HEADERS = sorted((Path(__file__).parent / "csrc").glob("*.h"))
_FUNCTIONS = [
    f"{op}_{suffix}"
    for op in (
        "decode_attention",
        "rms_norm",
        "silu_and_mul",
        "rotary_embedding",
        "rotary_write_kv_cache",
        "argmax_rows",
    )
    for suffix in ("f32", "bf16")
] + ["bind_omp_threads", "decode_stack", "small_linear_f32", "small_linear_bf16"]
# The decode kernel over fp8 caches (--kv-cache-dtype): a query dtype by a cache format.
_FP8_CACHE_FORMATS = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}
_FUNCTIONS += [
    f"decode_attention_{q}_{fmt}_chunked_scaled"
    for q in ("f32", "bf16")
    for fmt in _FP8_CACHE_FORMATS.values()
]
DTYPES = (torch.float32, torch.bfloat16)

_c_int64_p = ctypes.POINTER(ctypes.c_int64)


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def cpu_identity() -> str:
    """The CPU's model name and ISA flags: what -march=native code and measured plans depend
    on (not /proc/cpuinfo whole: its clock speeds change from one read to the next)."""
    model, flags = platform.processor(), ""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        info = ""
    for line in info.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == "model name":
            model = value.strip()
        elif name.strip() == "flags":
            flags = value.strip()
            break
    return f"{platform.machine()}|{model}|{flags}"


@functools.cache
def cpu_has_amx() -> bool:
    """Whether this CPU has AMX tiles: oneDNN's bfloat16 GEMMs (e.g. its
    `brg_matmul:avx10_1_512_amx` on a Sapphire Rapids) and torch's bfloat16 flash attention
    then run on them."""
    has_amx = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return has_amx is not None and bool(has_amx())


@functools.cache
def cpu_has_bf16_dot() -> bool:
    """Whether this CPU multiplies bfloat16 pairs in hardware (AVX512-BF16's `vdpbf16ps` or
    AMX-BF16 tiles): without one, oneDNN's bfloat16 GEMM emulates it, slower than float32."""
    flags = cpu_identity().rsplit("|", 1)[-1].split()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def cpu_isa() -> str:
    """The vector ISA torch's CPU kernels run and whether this CPU has AMX tiles, for the
    start-up log: 'AVX512, AMX' or 'AVX2, no AMX'."""
    amx = "AMX" if cpu_has_amx() else "no AMX"
    return f"{torch.backends.cpu.get_cpu_capability()}, {amx}"


def build_library(
    name: str,
    sources: Sequence[Path],
    compiler: str,
    key_files: Sequence[Path] = (),
    what: str = "the C kernels",
) -> Path:
    """sources compiled into <cache>/kernels/<name>-<key>.so, once per machine and source.

    The key hashes the bytes of sources and key_files (the headers they include), the
    compiler and cpu_identity(): -march=native code runs only on the CPU it was built for.
    The library is written under a temporary name and renamed into place; a build is logged
    as "built <what>".
    """
    source = b"".join(path.read_bytes() for path in (*sources, *key_files))
    key = hashlib.sha256(source + compiler.encode() + cpu_identity().encode()).hexdigest()[:16]
    out_dir = Path(CACHE_DIR.get()) / "kernels"
    target = out_dir / f"{name}-{key}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        tmp_target = Path(tmp) / target.name
        subprocess.run(
            [
                compiler,
                "-O3",
                "-march=native",
                "-fopenmp",
                "-fno-math-errno",
                "-shared",
                "-fPIC",
                "-o",
                str(tmp_target),
                *map(str, sources),
                "-lm",
            ],
            check=True,
            capture_output=True,
            timeout=120,
        )
        os.replace(tmp_target, target)  # atomic: concurrent builders race harmlessly
    logger.info("built %s: %s", what, target)
    return target


class NativeLibrary:
    """A C library built by build_library at first use and loaded once per process.

    Args:
        name: the .so's name before its key.
        sources: the C files compiled; key_files: the headers they include.
        functions: the library's functions, all returning void.
        label: what the log lines call one of its kernels ("CPU kernel").
        fallback: what runs without the library, for the log ("quantized matmuls use ...").
    """

    def __init__(
        self,
        name: str,
        sources: Sequence[Path],
        functions: Sequence[str],
        label: str,
        fallback: str,
        key_files: Sequence[Path] = (),
    ) -> None:
        self.name, self.sources, self.key_files = name, list(sources), list(key_files)
        self.functions, self.label, self.fallback = list(functions), label, fallback
        self.path: Path | None = None  # the loaded library's file
        self.error: str | None = None  # why there is no library, once loading failed
        self._lock = threading.Lock()
        self._lib: ctypes.CDLL | None = None

    def load(self) -> ctypes.CDLL | None:
        """The library (built if needed), or None where it cannot be built (logged once)."""
        with self._lock:
            if self._lib is not None or self.error is not None:
                return self._lib
            compiler = _compiler()
            if compiler is None:
                logger.warning("no C compiler: %s", self.fallback)
                self.error = "no C compiler (install gcc or set CC)"
                return None
            try:
                path = build_library(
                    self.name, self.sources, compiler, self.key_files, f"the {self.label}s"
                )
                lib = ctypes.CDLL(str(path))
            except (OSError, subprocess.SubprocessError) as exc:
                logger.warning("%s build failed (%s): using the torch reference", self.label, exc)
                self.error = f"the C kernel build failed ({exc})"
                return None
            for function in self.functions:
                getattr(lib, function).restype = None
            self.path, self._lib = path, lib
            return lib


_LIBRARY = NativeLibrary(
    "kvserve_cpu",
    _SOURCES,
    _FUNCTIONS,
    "CPU kernel",
    "the CPU kernels fall back to the torch references",
    key_files=_HEADERS,
)
_load = _LIBRARY.load
# The loaded library for the modules beside this one that call into it (decode_stack.py).
library = _LIBRARY.load


def library_file() -> str:
    """The loaded library's file name (its key hashes the sources, compiler and CPU), or ''
    without one: what a measurement of its kernels is valid for (kernels/gemm.py's plans)."""
    return _LIBRARY.path.name if library() is not None and _LIBRARY.path is not None else ""


def status() -> str:
    """The C kernels in use (building them if needed), or why the torch references run."""
    if _load() is None:
        return _LIBRARY.error or "not loaded"
    return f"C CPU kernels {_LIBRARY.path} for float32 and bfloat16"


def bind_threads(cpus: Sequence[int]) -> bool:
    """Pin torch's OpenMP threads one per CPU in cpus (thread 0, the caller, to cpus[0]); the
    team is len(cpus) threads. False where the library is missing or a pin failed."""
    lib = _load()
    if lib is None or not cpus:
        return False
    n = len(cpus)
    ok = (ctypes.c_int * n)()
    lib.bind_omp_threads((ctypes.c_int * n)(*cpus), ctypes.c_int(n), ok)
    return all(ok)


def bind_threads_to_share(share_index: int, num_shares: int) -> list[int] | None:
    """Pin this process's torch threads to its share of the CPUs it may run on: share
    share_index of num_shares equal runs of torch.get_num_threads() cores. Call it from the
    computing thread once the process's other threads are started (a thread inherits its
    creator's mask). The pinned CPUs, or None where they do not fit or the pin failed."""
    cpus = sorted(os.sched_getaffinity(0))
    per = torch.get_num_threads()
    chosen = cpus[share_index * per : (share_index + 1) * per]
    if len(chosen) < per or num_shares * per > len(cpus) or not bind_threads(chosen):
        logger.info(
            "torch threads not pinned: %d x %d threads on %d cores", num_shares, per, len(cpus)
        )
        return None
    logger.info("torch threads pinned to cores %s", ",".join(map(str, chosen)))
    return chosen


def available(dtype: torch.dtype) -> bool:
    """Whether the C kernels handle this dtype here (else use the torch references)."""
    return dtype in DTYPES and _load() is not None


def kv_readable_in_place(key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
    """Whether decode_attention can read these caches: one set of strides for K and V, each
    slot's [Hkv, D] contiguous (true of the paged caches)."""
    return (
        key_cache.stride(3) == 1
        and key_cache.stride(2) == key_cache.shape[3]
        and key_cache.stride() == value_cache.stride()
    )


def decode_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    token_rows: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    attention_chunk_size: int | None = None,
    sinks: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Attention of one query token per request, written into out[token_rows].

    Args:
        out: [T, Hq, D] contiguous; rows token_rows are written.
        query: [T, Hq, D], head dim contiguous (rows may be strided, e.g. a qkv split).
        key_cache, value_cache: [num_blocks, block_size, Hkv, D], each slot's [Hkv, D]
            contiguous, same strides; the query's dtype, or fp8 (float8_e4m3fn /
            float8_e5m2) read as k_scale * K and v_scale * V, converted in registers.
        block_table: [R, max_blocks] int32, row-contiguous; seq_lens: [R] int32.
        token_rows: [R] int64, the query row of each request.
        sliding_window: attend to only the last this many keys; None for all.
        soft_cap: scores become soft_cap * tanh(score / soft_cap); None for none.
        attention_chunk_size: attend to only the keys of the query's own chunk of this
            many positions (Llama 4's chunked local attention); None for all.
        sinks: [Hq] logits that join each head's softmax denominator (gpt-oss); None: none.
    """
    lib = _load()
    assert lib is not None
    assert query.stride(2) == 1 and out.is_contiguous()
    assert kv_readable_in_place(key_cache, value_cache)
    assert block_table.dtype == torch.int32 and block_table.stride(1) == 1
    seq_lens = seq_lens.to(torch.int32).contiguous()
    token_rows = token_rows.to(torch.int64).contiguous()
    num_heads, head_size = query.shape[1:]
    block_size, num_kv_heads = key_cache.shape[1:3]
    fn, scale, extra = _decode_attention_entry(lib, query, key_cache, scale, k_scale, v_scale)
    if sinks is not None:
        sinks = sinks.to(torch.float32).contiguous()
        assert sinks.shape == (num_heads,), (sinks.shape, num_heads)
    i64 = ctypes.c_int64
    fn(
        ctypes.c_void_p(out.data_ptr()),
        ctypes.c_void_p(query.data_ptr()),
        i64(query.stride(0)),
        i64(query.stride(1)),
        ctypes.c_void_p(key_cache.data_ptr()),
        ctypes.c_void_p(value_cache.data_ptr()),
        i64(key_cache.stride(0)),
        i64(key_cache.stride(1)),
        ctypes.c_void_p(block_table.data_ptr()),
        i64(block_table.stride(0)),
        ctypes.c_void_p(seq_lens.data_ptr()),
        ctypes.c_void_p(token_rows.data_ptr()),
        ctypes.c_int(seq_lens.shape[0]),
        ctypes.c_int(num_heads),
        ctypes.c_int(num_kv_heads),
        ctypes.c_int(head_size),
        ctypes.c_int(block_size),
        ctypes.c_float(scale),
        ctypes.c_int(sliding_window or 0),
        ctypes.c_float(soft_cap or 0.0),
        ctypes.c_int(attention_chunk_size or 0),
        _ptr(sinks),
        *extra,
    )


def _decode_attention_entry(
    lib: ctypes.CDLL,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    scale: float,
    k_scale: float,
    v_scale: float,
) -> tuple[Any, float, tuple[ctypes.c_float, ...]]:
    """decode_attention's C entry point for the query dtype and the cache format, the softmax
    scale it takes and its trailing arguments (an fp8 cache's value scale)."""
    query_kind = "f32" if query.dtype == torch.float32 else "bf16"
    cache_format = _FP8_CACHE_FORMATS.get(key_cache.dtype)
    if cache_format is None:
        assert key_cache.dtype == query.dtype, (key_cache.dtype, query.dtype)
        return getattr(lib, f"decode_attention_{query_kind}_chunked"), scale, ()
    # The key scale joins the softmax scale (score = scale * q . (k_scale * k)); the
    # value scale multiplies each output row once.
    fn = getattr(lib, f"decode_attention_{query_kind}_{cache_format}_chunked_scaled")
    return fn, scale * k_scale, (ctypes.c_float(v_scale),)


def _ptr(t: torch.Tensor | None) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr() if t is not None else None)


def _fn(name: str, dtype: torch.dtype):
    lib = _load()
    assert lib is not None
    return getattr(lib, f"{name}_{'f32' if dtype == torch.float32 else 'bf16'}")


def _check_rows(x: torch.Tensor) -> None:
    assert x.dim() == 2 and x.stride(1) == 1, "rows must be 2-D with a contiguous last dim"


@overload
def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: None = None
) -> torch.Tensor: ...


@overload
def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]: ...


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of x's rows [T, H]; with residual, of x + residual (rounded to x's dtype), and
    that sum is returned too. Same numbers as kernels.norm's references."""
    _check_rows(x)
    num_tokens, hidden_size = x.shape
    out = torch.empty((num_tokens, hidden_size), dtype=x.dtype)
    residual_out = None
    if residual is not None:
        _check_rows(residual)
        assert residual.shape == x.shape and residual.dtype == x.dtype
        residual_out = torch.empty_like(out)
    weight = weight.float().contiguous()
    _fn("rms_norm", x.dtype)(
        _ptr(out),
        _ptr(x),
        ctypes.c_int64(x.stride(0)),
        _ptr(residual),
        ctypes.c_int64(residual.stride(0) if residual is not None else 0),
        _ptr(residual_out),
        _ptr(weight),
        ctypes.c_int(num_tokens),
        ctypes.c_int(hidden_size),
        ctypes.c_float(eps),
    )
    if residual_out is None:
        return out
    return out, residual_out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2 * I] = [gate | up]; returns silu(gate) * up, [T, I]."""
    _check_rows(x)
    num_tokens, intermediate_size = x.shape[0], x.shape[1] // 2
    out = torch.empty((num_tokens, intermediate_size), dtype=x.dtype)
    _fn("silu_and_mul", x.dtype)(
        _ptr(out),
        _ptr(x),
        ctypes.c_int64(x.stride(0)),
        ctypes.c_int(num_tokens),
        ctypes.c_int(intermediate_size),
    )
    return out


def argmax(x: torch.Tensor) -> torch.Tensor | None:
    """torch.argmax(x, dim=-1) of a 2-D float32 / bfloat16 x with contiguous rows, in one C
    call (AVX-512 where the CPU has it; the first of equal maxima, NaN counting as the
    largest, as torch picks); None for other layouts (the caller runs torch's)."""
    if x.dim() != 2 or x.stride(1) != 1 or x.shape[1] == 0:
        return None
    out = torch.empty(x.shape[0], dtype=torch.int64)
    _fn("argmax_rows", x.dtype)(
        _ptr(out),
        _ptr(x),
        ctypes.c_int64(x.stride(0)),
        ctypes.c_int(x.shape[0]),
        ctypes.c_int(x.shape[1]),
    )
    return out


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> bool:
    """The paged KV write in one C call (kernels.cache's contract: key, value [T, Hkv, D], each
    token's Hkv * D values contiguous; a slot < 0 skipped). False, with nothing written, where
    the layouts are not the ones it copies (non-contiguous caches, strided heads): the caller
    then takes the reference."""
    num_tokens = key.shape[0]
    row = key.shape[1] * key.shape[2]
    packed = all(x.stride(2) == 1 and x.stride(1) == x.shape[2] for x in (key, value))
    if not (packed and key_cache.is_contiguous() and value_cache.is_contiguous()):
        return False
    lib = _load()
    assert lib is not None
    slots = slot_mapping.to(torch.int64).contiguous()
    item = key.element_size()
    lib.write_kv_cache_rows(
        _ptr(key_cache),
        _ptr(value_cache),
        _ptr(key),
        ctypes.c_int64(key.stride(0) * item),
        _ptr(value),
        ctypes.c_int64(value.stride(0) * item),
        _ptr(slots),
        ctypes.c_int(num_tokens),
        ctypes.c_int64(row * item),
    )
    return True


def prefill_attention_amx(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    chunk_reqs: Sequence[int],
    scale: float,
) -> bool:
    """Causal attention of the prefill chunks of requests chunk_reqs, all in one call on AMX
    tiles (bfloat16; csrc/prefill_attention_amx.c), written into their rows of out. Each
    chunk's rows attend to its context and, causally, to themselves. False, with nothing
    written, where it does not run: no AMX or AVX512-BF16 on this CPU, the kernel refused
    (head size not a multiple of 64 or over 256), caches not readable in place, a block
    table not int32 with contiguous rows.

    Args: as decode_attention's, plus query_start_loc [R + 1] and seq_lens [R].
    """
    if query.dtype != torch.bfloat16 or not chunk_reqs or not cpu_has_amx():
        return False
    if key_cache.dtype != query.dtype:  # an fp8 cache: the caller's flash route converts
        return False
    if not kv_readable_in_place(key_cache, value_cache):
        return False
    if block_table.dtype != torch.int32 or block_table.stride(1) != 1:
        return False
    lib = _load()
    assert lib is not None
    assert query.stride(2) == 1 and out.is_contiguous()
    reqs = torch.tensor(chunk_reqs, dtype=torch.int32)
    # int32 and contiguous, held alive through the call
    starts = query_start_loc.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    i64, cint = ctypes.c_int64, ctypes.c_int
    status = lib.prefill_attention_amx_bf16(
        _ptr(out),
        _ptr(query),
        i64(query.stride(0)),
        i64(query.stride(1)),
        _ptr(key_cache),
        _ptr(value_cache),
        i64(key_cache.stride(0)),
        i64(key_cache.stride(1)),
        _ptr(block_table),
        i64(block_table.stride(0)),
        _ptr(reqs),
        _ptr(starts),
        _ptr(lens),
        cint(len(chunk_reqs)),
        cint(query.shape[1]),
        cint(key_cache.shape[2]),
        cint(query.shape[2]),
        cint(key_cache.shape[1]),
        ctypes.c_float(scale),
    )
    return status == 0


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox rotary embedding; query [T, Hq * D] and key [T, Hkv * D] rows may be strided
    (views of a fused qkv). Returns new contiguous (query, key)."""
    from kvserve.kernels.rotary import _check_rotary_args

    _check_rotary_args(positions, query, key, cos_sin_cache, head_size)
    _check_rows(query)
    _check_rows(key)
    assert cos_sin_cache.dtype == torch.float32 and cos_sin_cache.is_contiguous()
    positions = positions.to(torch.int64).contiguous()
    q_out, k_out = (
        torch.empty(query.shape, dtype=query.dtype),
        torch.empty(key.shape, dtype=key.dtype),
    )
    _fn("rotary_embedding", query.dtype)(
        _ptr(q_out),
        _ptr(k_out),
        _ptr(query),
        ctypes.c_int64(query.stride(0)),
        _ptr(key),
        ctypes.c_int64(key.stride(0)),
        _ptr(positions),
        _ptr(cos_sin_cache),
        ctypes.c_int(query.shape[0]),
        ctypes.c_int(query.shape[1] // head_size),
        ctypes.c_int(key.shape[1] // head_size),
        ctypes.c_int(head_size),
    )
    return q_out, k_out


def rotary_write_kv_cache(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_size: int,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor | None:
    """rotary_embedding and write_kv_cache in one C pass: the rotated key goes straight into
    the cache. query [T, Hq * D], key and value [T, Hkv * D] rows may be strided (views of a
    fused qkv). Returns the rotated query, new and contiguous; None, with nothing done, where
    the caches are not contiguous: the caller then runs the two ops apart."""
    from kvserve.kernels.rotary import _check_rotary_args

    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        return None
    _check_rotary_args(positions, query, key, cos_sin_cache, head_size)
    for rows in (query, key, value):
        _check_rows(rows)
    assert value.shape == key.shape and key_cache.dtype == key.dtype == value_cache.dtype
    assert key_cache.shape[-2] * key_cache.shape[-1] == key.shape[1], "cache rows of Hkv * D"
    assert cos_sin_cache.dtype == torch.float32 and cos_sin_cache.is_contiguous()
    positions = positions.to(torch.int64).contiguous()
    slots = slot_mapping.to(torch.int64).contiguous()
    q_out = torch.empty(query.shape, dtype=query.dtype)
    i64 = ctypes.c_int64
    _fn("rotary_write_kv_cache", query.dtype)(
        _ptr(q_out),
        _ptr(query),
        i64(query.stride(0)),
        _ptr(key),
        i64(key.stride(0)),
        _ptr(value),
        i64(value.stride(0)),
        _ptr(positions),
        _ptr(cos_sin_cache),
        _ptr(key_cache),
        _ptr(value_cache),
        _ptr(slots),
        ctypes.c_int(query.shape[0]),
        ctypes.c_int(query.shape[1] // head_size),
        ctypes.c_int(key.shape[1] // head_size),
        ctypes.c_int(head_size),
    )
    return q_out
