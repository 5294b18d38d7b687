"""Weights held quantized: GGUF blocks (Q8_0, Q4_0, Q4_1, Q4_K), MXFP4 blocks (gpt-oss's
experts) and per-channel int8 (I8).

A `QuantizedTensor` is a weight [N, K] kept as its stored bytes: `data` is uint8
[N, bytes per row], each row a run of blocks along K (for I8, int8 values with one float
scale per row in `scales`). `quant_linear` computes y = x W^T (+ b) without the float weight:

    CPU, C kernels built   up to C_ROWS_MAX rows: kvq_gemm (kernels/csrc/quant_gemm.c),
                           activations quantized to int8 blocks, integer dot products (VNNI);
                           or, with KVSERVE_QUANT_ACTIVATIONS=float32, kvq_gemm_f32: tiles of
                           4 weight rows expanded to float32 in the kernel, float FMAs
                           more rows: weight rows dequantized in chunks of DEQUANT_CHUNK_BYTES
                           by the C kernel, each chunk multiplied by F.linear (MKL/oneDNN)
    CPU, no compiler       the torch reference: dequantize (torch ops), then F.linear
    CUDA                   the Triton kernel (kernels/quant_triton.py: dequantizes tiles in
                           registers, fp32 dots) via quant_linear_triton

The C library is built by kernels/cpu.py's NativeLibrary (same flags, cached per machine and
source hash) but as its own .so, so the two sources change independently.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from kvserve.kernels import int4, quant_triton
from kvserve.kernels._triton import require_triton, triton
from kvserve.kernels.cpu import NativeLibrary
from kvserve.shared.env import QUANT_ACTIVATIONS

# name -> (code shared with the C kernel = ggml's type number, elements, bytes per block)
QTYPES: dict[str, tuple[int, int, int]] = {
    "Q8_0": (8, 32, 34),
    "Q4_0": (2, 32, 18),
    "Q4_1": (3, 32, 20),
    "Q4_K": (12, 256, 144),
    "MXFP4": (39, 32, 17),
    "I8": (100, 1, 1),
    # W8A8: I8's bytes (the C kernels take it as I8), from an int8 checkpoint whose scheme
    # quantizes activations per token; more rows may run kernels/w8a8.py's int8 GEMM.
    "W8A8": (100, 1, 1),
    # 4-bit weight-only checkpoints (AWQ, GPTQ, compressed-tensors W4A16): per group of g a
    # float32 scale, an int8 zero point, g nibbles (kernels/int4.py, kernels/csrc/int4_gemm.c)
    "W4G32": (201, 32, 24),
    "W4G64": (202, 64, 40),
    "W4G128": (204, 128, 72),
}
# MXFP4 (OCP microscaling FP4, as gpt-oss checkpoints store it): per 32 elements one e8m0
# exponent byte e (scale 2^(e - 127)), then 16 bytes of e2m1 nibbles, the low nibble of byte j
# element 2j and the high one element 2j + 1. The checkpoint keeps the nibbles (`*_blocks`,
# [..., K/32, 16]) and the exponents (`*_scales`, [..., K/32]) apart; `mxfp4_from_checkpoint`
# puts each block's exponent before its 16 bytes (the bytes themselves unchanged), so a row is
# a run of 17-byte blocks like the GGUF types'.
E2M1_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)
GGUF_QTYPES = ("Q8_0", "Q4_0", "Q4_1", "Q4_K")

# Row counts up to this take the C kernel; more rows dequantize chunks of the weight and use
# the float GEMM. Measured on a 2-core EPYC (AVX-512 VNNI), SmolLM2-135M's shapes: the
# integer kernel is faster than dequantize + F.linear up to 64 rows on every shape (1.7-6x
# at 1-16 rows), 1.2-1.6x slower on the Q4_1 layers from 256 rows (bench/quantized.py
# --kernels, bench/RESULTS.md "Weights held quantized").
C_ROWS_MAX = 128
DEQUANT_CHUNK_BYTES = 8 << 20  # float32 bytes of weight rows expanded at a time (prefill)


def activations() -> str:
    """KVSERVE_QUANT_ACTIVATIONS: int8 (default) or float32, for the C kernel."""
    value = QUANT_ACTIVATIONS.get()
    if value not in ("int8", "float32"):
        raise ValueError(f"KVSERVE_QUANT_ACTIVATIONS must be int8 or float32, got {value!r}")
    return value


@dataclass
class QuantizedTensor:
    """A weight [N, K] held as stored blocks.

    Attributes:
        qtype: one of QTYPES.
        shape: (N, K) of the float weight it stands for.
        data: uint8 [N, row_bytes] (int8 reinterpreted for I8).
        scales: float32 [N] per-row scales of I8, else None.
        perm: int64 [K] or None: the columns were held permuted (W[:, perm], act-order
            checkpoints, kernels/int4.py); a matmul gathers x[:, perm].
    """

    qtype: str
    shape: tuple[int, int]
    data: torch.Tensor
    scales: torch.Tensor | None = None
    perm: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.qtype not in QTYPES:
            raise ValueError(f"unsupported quantized type {self.qtype!r}; have {sorted(QTYPES)}")
        n, k = self.shape
        if k % self.block_elems:
            raise ValueError(f"{self.qtype} needs K divisible by {self.block_elems}, got {k}")
        if tuple(self.data.shape) != (n, self.row_bytes) or self.data.dtype != torch.uint8:
            raise ValueError(
                f"{self.qtype} data must be uint8 {(n, self.row_bytes)}, got "
                f"{self.data.dtype} {tuple(self.data.shape)}"
            )

    @property
    def block_elems(self) -> int:
        return QTYPES[self.qtype][1]

    @property
    def row_bytes(self) -> int:
        _, elems, nbytes = QTYPES[self.qtype]
        return self.shape[1] // elems * nbytes

    @property
    def nbytes(self) -> int:
        extra = self.scales.numel() * 4 if self.scales is not None else 0
        if self.perm is not None:
            extra += self.perm.numel() * self.perm.element_size()
        return self.data.numel() + extra

    @property
    def device(self) -> torch.device:
        return self.data.device

    def narrow(self, dim: int, start: int, length: int) -> QuantizedTensor:
        """Rows [start, start + length) (dim 0), or columns (dim 1: block-aligned only)."""
        n, k = self.shape
        if dim == 0:
            scales = self.scales.narrow(0, start, length) if self.scales is not None else None
            return QuantizedTensor(
                self.qtype, (length, k), self.data.narrow(0, start, length), scales, self.perm
            )
        if dim != 1:
            raise ValueError(f"a weight has dims 0 and 1, not {dim}")
        if self.perm is not None and (start, length) != (0, k):
            raise ValueError(
                "an act-order weight (g_idx: its groups scattered over the input features) "
                "cannot be split along its input features (a row-parallel layer under tensor "
                "parallelism); use tensor-parallel size 1 or a checkpoint without act-order"
            )
        elems = self.block_elems
        if start % elems or length % elems:
            raise ValueError(
                f"cannot split {self.qtype} weight columns at [{start}, {start + length}): its "
                f"blocks hold {elems} input features; use a tensor-parallel size that splits "
                f"K={k} into multiples of {elems}"
            )
        bpb = QTYPES[self.qtype][2]
        data = self.data.narrow(1, start // elems * bpb, length // elems * bpb)
        return QuantizedTensor(self.qtype, (n, length), data, self.scales, self.perm)

    def split(self, sizes: list[int], dim: int = 0) -> list[QuantizedTensor]:
        assert dim == 0, "quantized weights split along rows"
        out, start = [], 0
        for size in sizes:
            out.append(self.narrow(0, start, size))
            start += size
        return out

    def permute_rows(self, fn) -> QuantizedTensor:
        """Rows reordered by fn (a function of a [N, ...] tensor that reorders dim 0)."""
        scales = fn(self.scales) if self.scales is not None else None
        data = fn(self.data).contiguous()
        return QuantizedTensor(self.qtype, self.shape, data, scales, self.perm)

    def contiguous(self) -> QuantizedTensor:
        scales = self.scales.contiguous() if self.scales is not None else None
        return QuantizedTensor(self.qtype, self.shape, self.data.contiguous(), scales, self.perm)

    def to(self, device: torch.device | str) -> QuantizedTensor:
        scales = self.scales.to(device) if self.scales is not None else None
        perm = self.perm.to(device) if self.perm is not None else None
        return QuantizedTensor(self.qtype, self.shape, self.data.to(device), scales, perm)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K] (C kernel on CPU where built, else torch ops)."""
        if self.qtype in _W4_QTYPES:
            return int4.dequantize(self)
        if self.device.type == "cpu" and _load() is not None:
            return dequantize_rows(self, None)
        return dequantize_ref(self)


def mxfp4_from_checkpoint(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """A checkpoint's MXFP4 pair as rows of 17-byte blocks: blocks uint8 [..., N, K/32, 16],
    scales uint8 [..., N, K/32] -> uint8 [..., N, K/32 * 17] (each block's exponent byte, then
    its 16 nibble bytes). Per row, the `data` of a QuantizedTensor("MXFP4", (N, K))."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8, got {blocks.dtype}, {scales.dtype}")
    if blocks.shape[-1] != 16 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)} "
            "(expected blocks [..., K/32, 16] and scales [..., K/32])"
        )
    packed = torch.cat((scales.unsqueeze(-1), blocks), dim=-1)  # [..., N, K/32, 17]
    return packed.flatten(-2)


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight [..., N, K] as a checkpoint's MXFP4 pair (blocks uint8 [..., N, K/32,
    16], scales uint8 [..., N, K/32]), the OCP MX way: per 32-block the exponent
    floor(log2(amax)) - 2 (e2m1's largest value is 1.5 * 2^2), each value divided by its
    power of two and rounded to the nearest e2m1 value (saturating at 6). For tests and
    benchmarks: the published checkpoints come quantized."""
    w = weight.detach().float()
    *prefix, n, k = w.shape
    if k % 32:
        raise ValueError(f"MXFP4 needs K divisible by 32, got {k}")
    blocks = w.reshape(*prefix, n, k // 32, 32)
    amax = blocks.abs().amax(dim=-1)
    exponent = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 2, torch.full_like(amax, -127))
    exponent = exponent.clamp(-127, 127)
    scaled = blocks / torch.exp2(exponent).unsqueeze(-1)
    magnitudes = torch.tensor(E2M1_VALUES[:8])
    codes = (scaled.abs().unsqueeze(-1) - magnitudes).abs().argmin(dim=-1)  # nearest, [0, 8)
    codes = codes + 8 * (scaled < 0)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return packed.contiguous(), (exponent + 127).to(torch.uint8)


def cat_rows(parts: list[QuantizedTensor]) -> QuantizedTensor:
    """Row-wise concatenation of same-type, same-K quantized weights."""
    qtype, k = parts[0].qtype, parts[0].shape[1]
    assert all(p.qtype == qtype and p.shape[1] == k for p in parts), "mixed types or K"
    if not all(same_perm(parts[0], p) for p in parts):
        raise ValueError("cannot concatenate weights whose columns are held in different orders")
    n = sum(p.shape[0] for p in parts)
    data = torch.cat([p.data for p in parts])
    # One qtype: every part has scales (I8) or none has.
    scales = (
        torch.cat([p.scales for p in parts if p.scales is not None])
        if parts[0].scales is not None
        else None
    )
    return QuantizedTensor(qtype, (n, k), data, scales, parts[0].perm)


def same_perm(a: QuantizedTensor, b: QuantizedTensor) -> bool:
    """Whether a and b hold their columns in the same order (cat_rows can join them)."""
    if a.perm is None or b.perm is None:
        return a.perm is None and b.perm is None
    return a.perm is b.perm or torch.equal(a.perm, b.perm)


_W4_QTYPES = ("W4G32", "W4G64", "W4G128")


# ---------------------------------------------------------------------- int8 weight-only


def quantize_int8(weight: torch.Tensor) -> QuantizedTensor:
    """Per-output-channel symmetric int8: q = round(w / s), s = max|w_row| / 127."""
    w = weight.detach().float()
    scales = w.abs().amax(dim=1).clamp_min(1e-30) / 127.0
    q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    n, k = w.shape
    return QuantizedTensor("I8", (n, k), q.view(torch.uint8).contiguous(), scales)


# ---------------------------------------------------------------------- torch reference


def _f16(data: torch.Tensor, offset: int) -> torch.Tensor:
    """The fp16 field at byte offset of every block: [..., nblocks] float32."""
    return data[..., offset : offset + 2].contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., 16] bytes -> [..., 32]: low nibbles (elements 0..15), then high (16..31)."""
    return torch.cat([qs & 15, qs >> 4], dim=-1).float()


def dequantize_ref(qt: QuantizedTensor) -> torch.Tensor:
    """The float32 weight from torch ops only (the fallback where no C compiler exists)."""
    n, k = qt.shape
    if qt.qtype in _W4_QTYPES:  # held column order
        return int4.dequantize_ref(qt)
    if qt.qtype in ("I8", "W8A8"):
        assert qt.scales is not None  # I8 always carries its per-row scales
        return qt.data.view(torch.int8).float() * qt.scales[:, None]
    _, elems, bpb = QTYPES[qt.qtype]
    blocks = qt.data.reshape(n, k // elems, bpb)
    if qt.qtype == "MXFP4":
        lut = torch.tensor(E2M1_VALUES, device=qt.data.device)
        qs = blocks[..., 1:].long()
        values = torch.stack((lut[qs & 15], lut[qs >> 4]), dim=-1).flatten(-2)  # [n, nb, 32]
        return torch.ldexp(values, blocks[..., :1].long() - 127).reshape(n, k)
    if qt.qtype == "Q8_0":
        out = _f16(blocks, 0)[..., None] * blocks[..., 2:].view(torch.int8).float()
    elif qt.qtype == "Q4_0":
        out = _f16(blocks, 0)[..., None] * (_nibbles(blocks[..., 2:]) - 8)
    elif qt.qtype == "Q4_1":
        out = _f16(blocks, 0)[..., None] * _nibbles(blocks[..., 4:]) + _f16(blocks, 2)[..., None]
    else:  # Q4_K
        d, dmin = _f16(blocks, 0)[..., None], _f16(blocks, 2)[..., None]
        s = blocks[..., 4:16].to(torch.int32)
        sc = torch.cat([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], -1)
        mn = torch.cat([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], -1)
        qs = blocks[..., 16:].reshape(n, k // elems, 4, 32)
        q = torch.stack([qs & 15, qs >> 4], dim=3).reshape(n, k // elems, 8, 32).float()
        out = (d * sc.float())[..., None] * q - (dmin * mn.float())[..., None]
    return out.reshape(n, k)


# ---------------------------------------------------------------------- the C library


_LIBRARY = NativeLibrary(
    "kvserve_quant",
    [Path(__file__).parent / "csrc" / "quant_gemm.c"],
    ("kvq_quantize_rows", "kvq_gemm", "kvq_gemm_f32", "kvq_dequantize_rows"),
    "quantized kernel",
    "quantized matmuls use the torch reference",
)
_load = _LIBRARY.load
# The loaded library, for the decode stack (kernels/decode_stack.py) that calls kvq_linear.
library = _LIBRARY.load
int4.use_quant_library(_LIBRARY.load)  # int4_gemm.c calls its activation quantization


def c_available() -> bool:
    """Whether the C quantized kernels are built here."""
    return _load() is not None


def _p(t: torch.Tensor | None) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr() if t is not None else None)


def _code(qt: QuantizedTensor) -> ctypes.c_int:
    return ctypes.c_int(QTYPES[qt.qtype][0])


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """x float32 [M, K] -> (int8 [M, K], scales, sums, scale * int sums), each [M, K/32]."""
    lib = _load()
    assert lib is not None
    m, k = x.shape
    qx = torch.empty(m, k, dtype=torch.int8)
    dx, sx, dsq = (torch.empty(m, k // 32) for _ in range(3))
    lib.kvq_quantize_rows(
        _p(x), ctypes.c_int64(x.stride(0)), ctypes.c_int(m), ctypes.c_int(k), _p(qx), _p(dx),
        _p(sx), _p(dsq),
    )  # fmt: skip
    return qx, dx, sx, dsq


def gemm_c(x: torch.Tensor, qt: QuantizedTensor, out: torch.Tensor) -> None:
    """out [M, N] (row-strided view allowed) = x W^T with the integer kernel; x float32."""
    lib = _load()
    assert lib is not None
    n, k = qt.shape
    assert out.stride(1) == 1 and qt.data.stride(1) == 1 and x.stride(1) == 1
    # One FFI call: the C side quantizes the activation rows into its own buffer.
    failed = lib.kvq_linear(
        _code(qt), _p(qt.data), ctypes.c_int64(qt.data.stride(0)), _p(qt.scales), ctypes.c_int(n),
        ctypes.c_int(k), _p(x), ctypes.c_int64(x.stride(0)), ctypes.c_int(x.shape[0]), _p(out),
        ctypes.c_int64(out.stride(0)),
    )  # fmt: skip
    if failed:
        raise MemoryError("the quantized GEMM could not allocate its activation buffer")


def gemm_f32_c(x: torch.Tensor, qt: QuantizedTensor, out: torch.Tensor) -> None:
    """out [M, N] (row-strided view allowed) = x W^T, float32 x, weight tiles expanded to
    float32 inside the kernel."""
    lib = _load()
    assert lib is not None
    n, k = qt.shape
    assert out.stride(1) == 1 and qt.data.stride(1) == 1 and x.stride(1) == 1
    lib.kvq_gemm_f32(
        _code(qt), _p(qt.data), ctypes.c_int64(qt.data.stride(0)), _p(qt.scales), ctypes.c_int(n),
        ctypes.c_int(k), _p(x), ctypes.c_int64(x.stride(0)), ctypes.c_int(x.shape[0]), _p(out),
        ctypes.c_int64(out.stride(0)),
    )  # fmt: skip


def dequantize_rows(
    qt: QuantizedTensor, rows: torch.Tensor | None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Float32 rows of W: all of them (rows None) or W[rows] (int64 ids), by the C kernel,
    into out (contiguous [count, K]) when given."""
    lib = _load()
    assert lib is not None and qt.data.stride(1) == 1
    n, k = qt.shape
    if rows is not None:
        rows = rows.to(torch.int64).contiguous()
    count = n if rows is None else rows.numel()
    if out is None:
        out = torch.empty(count, k)
    assert out.shape == (count, k) and out.is_contiguous() and out.dtype == torch.float32
    lib.kvq_dequantize_rows(
        _code(qt), _p(qt.data), ctypes.c_int64(qt.data.stride(0)), _p(qt.scales), _p(rows),
        ctypes.c_int(count), ctypes.c_int(k), _p(out), ctypes.c_int64(k),
    )  # fmt: skip
    return out


# ---------------------------------------------------------------------- matmul and lookup


def quant_linear_ref(x: torch.Tensor, qt: QuantizedTensor, bias: torch.Tensor | None = None):
    """Dequantize (torch ops), then F.linear: the fallback and a reference."""
    y = F.linear(x.float(), dequantize_ref(qt).to(x.device), None)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def quant_linear(
    x: torch.Tensor,
    qt: QuantizedTensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = x W^T (+ bias) for x [M, K], W held quantized; written into out [M, N] if given
    (a float32 view whose last dim is contiguous, e.g. columns of a wider output)."""
    if qt.qtype in _W4_QTYPES:
        return int4.w4_linear(x, qt, bias, out)
    if x.is_cuda:
        y = quant_linear_triton(x, qt, bias)
    elif _load() is None:
        y = quant_linear_ref(x, qt, bias)
    else:
        y = _quant_linear_cpu(x, qt, bias, out)
        if out is not None:
            return out
    if out is not None:
        out.copy_(y)
        return out
    return y


def _quant_linear_cpu(x, qt, bias, out):
    # W8A8: the per-token int8 GEMM where measured faster (KVSERVE_QUANT_ACTIVATIONS=float32
    # keeps the kernel that expands weight tiles instead)
    if qt.qtype == "W8A8" and out is None and activations() == "int8":
        from kvserve.kernels import w8a8

        def run_kvq(rows):
            return _quant_linear_blocks(rows, qt, None, None)

        def run_intmm(rows):
            return w8a8.linear_intmm(rows, qt.data.view(torch.int8), qt.scales)

        n, k = qt.shape
        if w8a8.kernel_for(x.shape[0], n, k, x.dtype, run_kvq, run_intmm) == "intmm":
            return w8a8.linear_intmm(x, qt.data.view(torch.int8), qt.scales, bias)
    return _quant_linear_blocks(x, qt, bias, out)


def _quant_linear_blocks(x, qt, bias, out):
    xf = x.float()
    if xf.stride(1) != 1:
        xf = xf.contiguous()
    m, (n, k) = xf.shape[0], qt.shape
    y = out if out is not None and out.dtype == torch.float32 else torch.empty(m, n)
    if m <= C_ROWS_MAX and k % 32 == 0:
        (gemm_f32_c if activations() == "float32" else gemm_c)(xf, qt, y)
    else:
        chunk = max(1, DEQUANT_CHUNK_BYTES // (4 * k))
        scratch = _scratch(min(chunk, n) * k)
        for start in range(0, n, chunk):
            rows = min(chunk, n - start)
            w = dequantize_rows(qt.narrow(0, start, rows), None, scratch[: rows * k].view(rows, k))
            if rows == n and y.is_contiguous():
                torch.matmul(xf, w.t(), out=y)
            else:
                y[:, start : start + rows] = F.linear(xf, w)
    if bias is not None:
        y += bias.float()
    if out is not None and y is not out:
        out.copy_(y)
        return out
    return y if x.dtype == torch.float32 else y.to(x.dtype)


_scratch_local = threading.local()


def _scratch(numel: int) -> torch.Tensor:
    """A reused float32 buffer of at least numel (per thread): a fresh multi-MB tensor per
    call costs its page faults, more than the dequantization itself."""
    buf = getattr(_scratch_local, "buf", None)
    if buf is None or buf.numel() < numel:
        buf = _scratch_local.buf = torch.empty(numel)
    return buf


def quant_embedding(ids: torch.Tensor, qt: QuantizedTensor) -> torch.Tensor:
    """Rows W[ids] as float32 [T, K] (a dequantizing embedding lookup)."""
    flat = ids.reshape(-1)
    if qt.device.type == "cpu" and _load() is not None:
        rows = dequantize_rows(qt, flat)
    else:
        rows = _lookup_ref(qt, flat)
    return rows.reshape(*ids.shape, qt.shape[1])


def _lookup_ref(qt: QuantizedTensor, flat: torch.Tensor) -> torch.Tensor:
    data = qt.data[flat]
    scales = qt.scales[flat] if qt.scales is not None else None
    return dequantize_ref(QuantizedTensor(qt.qtype, (flat.numel(), qt.shape[1]), data, scales))


# ------------------------------------------- Triton (GPU): the kernel in kernels/quant_triton.py


def quant_linear_triton(x: torch.Tensor, qt: QuantizedTensor, bias: torch.Tensor | None = None):
    """y = x W^T (+ bias) on the GPU: each program dequantizes [BLOCK_N, 32] weight tiles in
    registers and accumulates fp32 dot products for BLOCK_M activation rows."""
    require_triton("quant_linear")
    m, k = x.shape
    n = qt.shape[0]
    code, elems, bpb = QTYPES[qt.qtype]
    xf = x.float().contiguous()
    y = torch.empty(m, n, dtype=torch.float32, device=x.device)
    scales = qt.scales if qt.scales is not None else y  # unused unless I8
    block_m, block_n = 16, 32
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    quant_triton._quant_linear_kernel[grid](
        xf, qt.data, scales, y, m, n, k,
        xf.stride(0), qt.data.stride(0), y.stride(0),
        QTYPE=code, BLOCK_BYTES=bpb, SUPER=elems, BLOCK_M=block_m, BLOCK_N=block_n,
    )  # fmt: skip
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype)
