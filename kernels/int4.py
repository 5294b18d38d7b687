"""4-bit weight-only checkpoints (AWQ, GPTQ, compressed-tensors W4A16) held as W4G<g> blocks.

One held type for the three formats: a weight [N, K] whose rows are K/g blocks, one per group
of g input features (g = 32, 64, 128), each a float32 scale s, an int8 zero point z and g
unsigned 4-bit values q (layout in kernels/csrc/int4_gemm.c); w = (q - z) * s in float32,
bit for bit the tools' own dequantization. A checkpoint's group of 256 or more is held as
groups of 128 sharing its scale, a per-channel scale as groups of 32 sharing the row's (so a
tensor-parallel split of K at any multiple of 32 keeps whole groups).

Act-order (GPTQ `desc_act`, compressed-tensors `actorder: group`) stores a column's group in
`g_idx`, so a group's columns are scattered over K. The held weight's columns are permuted
once at load (stable argsort of g_idx) so each group is contiguous again, and the
activations are gathered by the same permutation per call (`QuantizedTensor.perm`; y = x[:,
perm] W_held^T). The alternative, g_idx read in the kernel, would give each element its own
scale: no integer dot product over a 32-run, a float expansion per element.

`w4_linear` runs:

    CPU, C kernels built   up to W4_C_ROWS_MAX rows: w4_linear (int4_gemm.c), activations
                           quantized to int8 blocks of 32, VNNI integer dot products
                           more rows, or KVSERVE_QUANT_ACTIVATIONS=float32: rows dequantized
                           in chunks, F.linear on each chunk (no activation rounding)
    CPU, no compiler       the torch reference: dequantize, then F.linear
    CUDA                   the Triton kernel (tiles dequantized in registers)
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F

from kvserve.kernels._triton import HAS_TRITON, require_triton, tl, triton
from kvserve.kernels.cpu import NativeLibrary
from kvserve.shared.env import QUANT_ACTIVATIONS


class HeldWeight(Protocol):
    """What these kernels read of a kernels/quant.py QuantizedTensor (which imports this
    module, so it is not imported here)."""

    qtype: str
    shape: tuple[int, int]
    data: torch.Tensor
    perm: torch.Tensor | None

    @property
    def device(self) -> torch.device: ...

    def narrow(self, dim: int, start: int, length: int) -> HeldWeight: ...


# The held types: name -> group size (QTYPES has their codes and block bytes).
W4_GROUPS = {"W4G32": 32, "W4G64": 64, "W4G128": 128}
W4_HEADER = 8  # float32 scale, int8 zero, 3 bytes of padding

# Row counts up to this take the integer kernel, more the dequantize + F.linear path.
# Measured on this machine (2 cores of a Sapphire Rapids, AVX-512 VNNI), SmolLM2-135M's
# shapes, W4G64 (bench/int4.py --kernels, bench/RESULTS.md "4-bit checkpoints"): summed over
# a layer's linears the integer kernel is 1.4x faster at 32 rows and even at 64; the float
# path wins from 128 (and on the narrow k / v shapes from 16).
W4_C_ROWS_MAX = 64
DEQUANT_CHUNK_BYTES = 8 << 20


def group_qtype(group: int) -> str:
    name = f"W4G{group}"
    if name not in W4_GROUPS:
        raise ValueError(f"no held 4-bit type for groups of {group}; have {sorted(W4_GROUPS)}")
    return name


def block_bytes(qtype: str) -> int:
    return W4_HEADER + W4_GROUPS[qtype] // 2


def held_group(group: int, k: int) -> int:
    """The held group size for a checkpoint's group (k for per-channel): the largest of 128,
    64, 32 that divides both (a larger group is held as several sharing one scale)."""
    for held in (128, 64, 32):
        if group % held == 0 and k % held == 0:
            return held
    raise ValueError(
        f"4-bit groups of {group} input features over K={k} are not supported: the group "
        "size and K must be multiples of 32"
    )


def pack_w4_blocks(
    q: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group: int,
    g_idx: torch.Tensor | None = None,
) -> tuple[str, torch.Tensor, torch.Tensor | None]:
    """A weight as W4G blocks: (qtype, data uint8 [N, row bytes], perm [K] or None), the
    fields of its QuantizedTensor (services/worker/quant_formats/int4.py `pack_w4`).

    Args:
        q: [N, K] integers in 0..15 (the unsigned 4-bit values, original column order).
        scales: [N, G] float (any float dtype; converted to float32 exactly).
        zeros: [N, G] integers (the zero point on q's scale, e.g. 8 for symmetric).
        group: input features per scale (K for per-channel: G = 1).
        g_idx: [K] the group of each column (act-order), or None for column // group.
    """
    n, k = q.shape
    if scales.shape != zeros.shape or scales.shape[0] != n:
        raise ValueError(
            f"4-bit scales {tuple(scales.shape)} / zeros {tuple(zeros.shape)} vs N={n}"
        )
    if int(q.min()) < 0 or int(q.max()) > 15:
        raise ValueError("4-bit values outside 0..15")
    if int(zeros.min()) < -128 or int(zeros.max()) > 127:
        raise ValueError("4-bit zero points outside int8")
    num_groups = scales.shape[1]
    perm = None
    if g_idx is not None:
        g_idx = g_idx.to(torch.int64)
        if g_idx.shape != (k,) or int(g_idx.min()) < 0 or int(g_idx.max()) >= num_groups:
            raise ValueError(f"g_idx must be [K={k}] groups in 0..{num_groups - 1}")
        trivial = torch.arange(k) // group
        if not torch.equal(g_idx, trivial):
            counts = torch.bincount(g_idx, minlength=num_groups)
            if not bool((counts == group).all()):
                raise ValueError(
                    f"act-order g_idx with groups of other than {group} columns "
                    f"({sorted(set(counts.tolist()))}) is not supported"
                )
            perm = torch.argsort(g_idx, stable=True)
            q = q[:, perm]
    if num_groups * group != k:
        raise ValueError(f"{num_groups} groups of {group} do not cover K={k}")
    # per channel: groups of 32 sharing the row's scale, so a tensor-parallel split of K at
    # any multiple of 32 keeps whole groups
    held = held_group(32 if num_groups == 1 else group, k)
    repeat = group // held
    scales = scales.float().repeat_interleave(repeat, dim=1)  # [N, K / held]
    zeros = zeros.to(torch.int8).repeat_interleave(repeat, dim=1)
    groups = k // held
    header = torch.zeros(n, groups, W4_HEADER, dtype=torch.uint8)
    header[..., 0:4] = scales.contiguous().view(torch.uint8).view(n, groups, 4)
    header[..., 4] = zeros.view(torch.uint8)
    runs = q.to(torch.uint8).reshape(n, groups, held // 32, 2, 16)
    nibbles = (runs[..., 0, :] | (runs[..., 1, :] << 4)).reshape(n, groups, held // 2)
    data = torch.cat([header, nibbles], dim=-1).reshape(n, -1).contiguous()
    return group_qtype(held), data, perm


def unpack_w4(qt: HeldWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q uint8 [N, K], scales float32 [N, K/g], zeros int8 [N, K/g]) in held column order."""
    n, k = qt.shape
    g = W4_GROUPS[qt.qtype]
    blocks = qt.data.reshape(n, k // g, block_bytes(qt.qtype))
    scales = blocks[..., 0:4].contiguous().view(torch.float32).squeeze(-1)
    zeros = blocks[..., 4].contiguous().view(torch.int8)
    qs = blocks[..., W4_HEADER:].reshape(n, k // g, g // 32, 1, 16)
    q = torch.cat([qs & 15, qs >> 4], dim=3).reshape(n, k)
    return q, scales, zeros


def dequantize_ref(qt: HeldWeight) -> torch.Tensor:
    """The float32 weight in held column order (torch ops): (q - z) * s."""
    n, k = qt.shape
    g = W4_GROUPS[qt.qtype]
    q, scales, zeros = unpack_w4(qt)
    w = (q.float().reshape(n, k // g, g) - zeros.float()[..., None]) * scales[..., None]
    return w.reshape(n, k)


def unpermute(w: torch.Tensor, perm: torch.Tensor | None) -> torch.Tensor:
    """Held column order -> the checkpoint's (W[:, perm] was held)."""
    if perm is None:
        return w
    out = torch.empty_like(w)
    out[:, perm.to(w.device)] = w
    return out


# ---------------------------------------------------------------------- the C library

_LIBRARY = NativeLibrary(
    "kvserve_int4",
    [Path(__file__).parent / "csrc" / "int4_gemm.c"],
    ("w4_dequantize_rows", "w4_init"),
    "4-bit kernel",
    "4-bit matmuls use the torch reference",
)
_init_lock = threading.Lock()
_initialized: list[ctypes.CDLL] = []
# quant_gemm.c's library loader, registered by kernels/quant.py (which imports this module).
_quant_library: list = []


def use_quant_library(load) -> None:
    """kernels/quant.py's library loader: its kvq_quantize_rows and kvq_linear are handed to
    int4_gemm.c at first use."""
    _quant_library[:] = [load]


def _load() -> ctypes.CDLL | None:
    """The library, given quant_gemm.c's activation quantization and kvq_linear once (None
    where either C library cannot be built)."""
    lib = _LIBRARY.load()
    if lib is None or _initialized:
        return lib
    quant_lib = _quant_library[0]() if _quant_library else None
    if quant_lib is None:
        return None
    with _init_lock:
        if not _initialized:
            lib.w4_init(
                ctypes.cast(quant_lib.kvq_quantize_rows, ctypes.c_void_p),
                ctypes.cast(quant_lib.kvq_linear, ctypes.c_void_p),
            )
            _initialized.append(lib)
    return lib


library = _load  # for the decode stack (kernels/decode_stack.py: w4_any_linear)


def c_available() -> bool:
    return _load() is not None


def _p(t: torch.Tensor | None) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr() if t is not None else None)


def gemm_c(x: torch.Tensor, qt: HeldWeight, out: torch.Tensor) -> None:
    """out [M, N] (last dim contiguous) = x W_held^T, x float32 in held column order."""
    lib = _load()
    assert lib is not None
    n, k = qt.shape
    assert out.stride(1) == 1 and qt.data.stride(1) == 1 and x.stride(1) == 1
    failed = lib.w4_linear(
        ctypes.c_int(W4_GROUPS[qt.qtype]), _p(qt.data), ctypes.c_int64(qt.data.stride(0)),
        ctypes.c_int(n), ctypes.c_int(k), _p(x), ctypes.c_int64(x.stride(0)),
        ctypes.c_int(x.shape[0]), _p(out), ctypes.c_int64(out.stride(0)),
    )  # fmt: skip
    if failed:
        raise MemoryError("the 4-bit GEMM could not allocate its activation buffer")


def dequantize_rows_c(qt: HeldWeight, out: torch.Tensor | None = None) -> torch.Tensor:
    """Every row as float32 [N, K] in held column order, by the C kernel."""
    lib = _load()
    assert lib is not None and qt.data.stride(1) == 1
    n, k = qt.shape
    if out is None:
        out = torch.empty(n, k)
    assert out.shape == (n, k) and out.is_contiguous() and out.dtype == torch.float32
    lib.w4_dequantize_rows(
        ctypes.c_int(W4_GROUPS[qt.qtype]), _p(qt.data), ctypes.c_int64(qt.data.stride(0)),
        ctypes.c_void_p(None), ctypes.c_int(n), ctypes.c_int(k), _p(out), ctypes.c_int64(k),
    )  # fmt: skip
    return out


def dequantize(qt: HeldWeight) -> torch.Tensor:
    """The float32 weight [N, K] in the checkpoint's column order."""
    if qt.device.type == "cpu" and c_available():
        w = dequantize_rows_c(qt)
    else:
        w = dequantize_ref(qt)
    return unpermute(w, qt.perm)


# ---------------------------------------------------------------------- matmul


def activations() -> str:
    """KVSERVE_QUANT_ACTIVATIONS (as kernels/quant.py reads it): int8 runs the integer kernel
    at few rows, float32 always the dequantize + F.linear path."""
    value = QUANT_ACTIVATIONS.get()
    if value not in ("int8", "float32"):
        raise ValueError(f"KVSERVE_QUANT_ACTIVATIONS must be int8 or float32, got {value!r}")
    return value


_scratch_local = threading.local()


def _scratch(numel: int) -> torch.Tensor:
    """A reused float32 buffer of at least numel per thread (the many-row path's chunks)."""
    buf = getattr(_scratch_local, "buf", None)
    if buf is None or buf.numel() < numel:
        buf = _scratch_local.buf = torch.empty(numel)
    return buf


def w4_linear_ref(x: torch.Tensor, qt: HeldWeight, bias: torch.Tensor | None = None):
    """Dequantize (torch ops), then F.linear: the fallback and a reference."""
    w = unpermute(dequantize_ref(qt), qt.perm).to(x.device)
    y = F.linear(x.float(), w)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def w4_linear(
    x: torch.Tensor,
    qt: HeldWeight,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = x W^T (+ bias) for x [M, K] (the checkpoint's column order), into out if given."""
    if x.is_cuda:
        y = w4_linear_triton(x, qt, bias)
    elif not c_available():
        y = w4_linear_ref(x, qt, bias)
    else:
        y = _w4_linear_cpu(x, qt, bias, out)
    if out is not None:
        if y is not out:
            out.copy_(y)
        return out
    return y


def _w4_linear_cpu(x, qt, bias, out):
    xf = x.float()
    if qt.perm is not None:
        xf = xf.index_select(1, qt.perm)
    elif xf.stride(1) != 1:
        xf = xf.contiguous()
    m, (n, k) = xf.shape[0], qt.shape
    y = out if out is not None and out.dtype == torch.float32 else torch.empty(m, n)
    if m <= W4_C_ROWS_MAX and activations() == "int8":
        gemm_c(xf, qt, y)
    else:
        chunk = max(1, DEQUANT_CHUNK_BYTES // (4 * k))
        scratch = _scratch(min(chunk, n) * k)
        for start in range(0, n, chunk):
            rows = min(chunk, n - start)
            w = dequantize_rows_c(qt.narrow(0, start, rows), scratch[: rows * k].view(rows, k))
            if rows == n and y.is_contiguous():
                torch.matmul(xf, w.t(), out=y)
            else:
                y[:, start : start + rows] = F.linear(xf, w)
    if bias is not None:
        y += bias.float()
    if out is not None:
        return y
    return y if x.dtype == torch.float32 else y.to(x.dtype)


# ---------------------------------------------------------------------- Triton (GPU)


def w4_linear_triton(x: torch.Tensor, qt: HeldWeight, bias: torch.Tensor | None = None):
    """y = x W^T (+ bias) on the GPU: each program dequantizes [BLOCK_N, 32] runs of W4G
    blocks in registers and accumulates fp32 dot products for BLOCK_M activation rows."""
    require_triton("w4_linear")
    xf = x.float()
    if qt.perm is not None:
        xf = xf.index_select(1, qt.perm.to(x.device))
    xf = xf.contiguous()
    m, k = xf.shape
    n = qt.shape[0]
    y = torch.empty(m, n, dtype=torch.float32, device=x.device)
    block_m, block_n = 16, 32
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _w4_kernel[grid](
        xf, qt.data, y, m, n, k, xf.stride(0), qt.data.stride(0), y.stride(0),
        GROUP=W4_GROUPS[qt.qtype], BLOCK_BYTES=block_bytes(qt.qtype), BLOCK_M=block_m,
        BLOCK_N=block_n,
    )  # fmt: skip
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype)


if HAS_TRITON:

    @triton.jit
    def _w4_kernel(
        x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
        GROUP: tl.constexpr, BLOCK_BYTES: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok = rm < M
        n_ok = rn < N
        nm = n_ok[:, None]
        i = tl.arange(0, 32)[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        row = w_ptr + rn[:, None].to(tl.int64) * stride_wn
        for kb in range(0, K // 32):
            base = row + (kb // (GROUP // 32)) * BLOCK_BYTES
            b0 = tl.load(base, mask=nm, other=0).to(tl.uint32)
            b1 = tl.load(base + 1, mask=nm, other=0).to(tl.uint32)
            b2 = tl.load(base + 2, mask=nm, other=0).to(tl.uint32)
            b3 = tl.load(base + 3, mask=nm, other=0).to(tl.uint32)
            scale = (b0 | (b1 << 8) | (b2 << 16) | (b3 << 24)).to(tl.float32, bitcast=True)
            zero = tl.load(base + 4, mask=nm, other=0).to(tl.int8, bitcast=True).to(tl.float32)
            run = base + 8 + (kb % (GROUP // 32)) * 16
            byte = tl.load(run + (i % 16), mask=nm, other=0)
            nib = tl.where(i < 16, byte & 15, byte >> 4).to(tl.float32)
            w = (nib - zero) * scale
            xk = tl.load(
                x_ptr + rm[:, None] * stride_xm + kb * 32 + i, mask=m_ok[:, None], other=0.0
            )
            acc += tl.dot(xk, tl.trans(w), input_precision="ieee")
        tl.store(
            y_ptr + rm[:, None] * stride_ym + rn[None, :], acc, mask=m_ok[:, None] & n_ok[None, :]
        )
