"""Native CPU kernels: small C sources compiled at first use, called through ctypes.

The torch references gather paged K/V into padded copies; for decode attention that copy
costs more than the attention itself on CPU. The C kernel reads K/V in place through the block
table. It is built once per machine into the kvserve cache folder (`cc -O3 -march=native
-fopenmp -fno-math-errno`, about a second) and shares torch's OpenMP runtime. Without a C
compiler, callers fall back to the torch reference (`available()` is False).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from shared.env import CACHE_DIR
from shared.logging import init_logger

logger = init_logger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "decode_attention.c"
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_failed = False

_c_int64_p = ctypes.POINTER(ctypes.c_int64)


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _build(compiler: str) -> Path:
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(source + platform.machine().encode() + compiler.encode()
                         + Path("/proc/cpuinfo").read_bytes()[:4096]
                         if Path("/proc/cpuinfo").exists() else source).hexdigest()[:16]
    out_dir = Path(CACHE_DIR.get()) / "kernels"
    target = out_dir / f"decode_attention-{key}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        tmp_target = Path(tmp) / target.name
        subprocess.run([compiler, "-O3", "-march=native", "-fopenmp", "-fno-math-errno",
                        "-shared", "-fPIC", "-o", str(tmp_target), str(_SOURCE), "-lm"],
                       check=True, capture_output=True, timeout=120)
        os.replace(tmp_target, target)  # atomic: concurrent builders race harmlessly
    logger.info("built the CPU decode-attention kernel: %s", target)
    return target


def _load() -> ctypes.CDLL | None:
    global _lib, _failed
    with _lock:
        if _lib is not None or _failed:
            return _lib
        compiler = _compiler()
        if compiler is None:
            logger.warning("no C compiler: CPU decode attention uses the torch reference")
            _failed = True
            return None
        try:
            lib = ctypes.CDLL(str(_build(compiler)))
        except (OSError, subprocess.SubprocessError) as exc:
            logger.warning("CPU kernel build failed (%s): using the torch reference", exc)
            _failed = True
            return None
        for name in ("decode_attention_f32", "decode_attention_bf16"):
            getattr(lib, name).restype = None
        _lib = lib
        return _lib


def available(dtype: torch.dtype) -> bool:
    """Whether the C decode kernel handles this dtype here (else use the torch reference)."""
    return dtype in (torch.float32, torch.bfloat16) and _load() is not None


def decode_attention(out: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor,
                     value_cache: torch.Tensor, block_table: torch.Tensor,
                     seq_lens: torch.Tensor, token_rows: torch.Tensor, scale: float) -> None:
    """Attention of one query token per request, written into out[token_rows].

    Args:
        out: [T, Hq, D] contiguous; rows token_rows are written.
        query: [T, Hq, D], head dim contiguous (rows may be strided, e.g. a qkv split).
        key_cache, value_cache: [num_blocks, block_size, Hkv, D], each slot's [Hkv, D]
            contiguous, same strides.
        block_table: [R, max_blocks] int32, row-contiguous; seq_lens: [R] int32.
        token_rows: [R] int64, the query row of each request.
    """
    lib = _load()
    assert lib is not None
    assert query.stride(2) == 1 and out.is_contiguous()
    assert key_cache.stride(3) == 1 and key_cache.stride(2) == key_cache.shape[3]
    assert key_cache.stride() == value_cache.stride()
    assert block_table.dtype == torch.int32 and block_table.stride(1) == 1
    seq_lens = seq_lens.to(torch.int32).contiguous()
    token_rows = token_rows.to(torch.int64).contiguous()
    num_heads, head_size = query.shape[1:]
    block_size, num_kv_heads = key_cache.shape[1:3]
    fn = lib.decode_attention_f32 if query.dtype == torch.float32 else lib.decode_attention_bf16
    i64 = ctypes.c_int64
    fn(ctypes.c_void_p(out.data_ptr()), ctypes.c_void_p(query.data_ptr()),
       i64(query.stride(0)), i64(query.stride(1)),
       ctypes.c_void_p(key_cache.data_ptr()), ctypes.c_void_p(value_cache.data_ptr()),
       i64(key_cache.stride(0)), i64(key_cache.stride(1)),
       ctypes.c_void_p(block_table.data_ptr()), i64(block_table.stride(0)),
       ctypes.c_void_p(seq_lens.data_ptr()), ctypes.c_void_p(token_rows.data_ptr()),
       ctypes.c_int(seq_lens.shape[0]), ctypes.c_int(num_heads), ctypes.c_int(num_kv_heads),
       ctypes.c_int(head_size), ctypes.c_int(block_size), ctypes.c_float(scale))
