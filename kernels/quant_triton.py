"""The Triton kernel of `quant_linear_triton` (kernels/quant.py, the GPU path of quant_linear):
y = x W^T with W held as its quantized blocks, dequantized [BLOCK_N, 32] tile by tile in
registers, one @triton.jit helper per block format.
"""

from __future__ import annotations

from kvserve.kernels._triton import HAS_TRITON, tl, triton

if HAS_TRITON:

    @triton.jit
    def _f16_at(ptr, mask):
        """The little-endian fp16 at byte pointers ptr, as float32."""
        lo = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
        hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
        return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _q8_0_block(base, i, nm):
        """Q8_0: d, 32 x int8."""
        q = tl.load(base + 2 + i, mask=nm, other=0).to(tl.int8, bitcast=True)
        return _f16_at(base, nm) * q.to(tl.float32)

    @triton.jit
    def _q4_0_block(base, i, nm):
        """Q4_0: d, 16 bytes of nibbles (lo = 0..15, hi = 16..31)."""
        byte = tl.load(base + 2 + (i % 16), mask=nm, other=0)
        nib = tl.where(i < 16, byte & 15, byte >> 4).to(tl.float32)
        return _f16_at(base, nm) * (nib - 8.0)

    @triton.jit
    def _q4_1_block(base, i, nm):
        """Q4_1: d, m, 16 bytes of nibbles."""
        byte = tl.load(base + 4 + (i % 16), mask=nm, other=0)
        nib = tl.where(i < 16, byte & 15, byte >> 4).to(tl.float32)
        return _f16_at(base, nm) * nib + _f16_at(base + 2, nm)

    @triton.jit
    def _mxfp4_block(base, i, nm):
        """MXFP4: e8m0 exponent, 16 bytes (lo = element 2j, hi = 2j + 1)."""
        exponent = tl.load(base, mask=nm, other=127).to(tl.float32)
        byte = tl.load(base + 1 + i // 2, mask=nm, other=0)
        nib = tl.where(i % 2 == 0, byte & 15, byte >> 4).to(tl.int32)
        mag = nib & 7
        # e2m1: 0, 0.5 for mag 0, 1; else (1 + (mag & 1) / 2) * 2^((mag >> 1) - 1)
        value = tl.where(
            mag < 2,
            mag.to(tl.float32) * 0.5,
            (1.0 + (mag & 1).to(tl.float32) * 0.5) * tl.exp2(((mag >> 1) - 1).to(tl.float32)),
        )
        value = tl.where(nib >= 8, -value, value)
        return value * tl.exp2(exponent - 127.0)

    @triton.jit
    def _q4_k_block(row, kb, i, nm, BLOCK_BYTES: tl.constexpr):
        """Q4_K: sub-block j of super-block kb // 8 (6-bit scales and mins, packed)."""
        j = kb % 8
        jj = j % 4
        base = row + (kb // 8) * BLOCK_BYTES
        a = tl.load(base + 4 + jj, mask=nm, other=0).to(tl.int32)
        b = tl.load(base + 8 + jj, mask=nm, other=0).to(tl.int32)
        c = tl.load(base + 12 + jj, mask=nm, other=0).to(tl.int32)
        sc = tl.where(j < 4, a & 63, (c & 15) | ((a >> 6) << 4)).to(tl.float32)
        mn = tl.where(j < 4, b & 63, (c >> 4) | ((b >> 6) << 4)).to(tl.float32)
        byte = tl.load(base + 16 + 32 * (j // 2) + i, mask=nm, other=0)
        nib = tl.where(j % 2 == 0, byte & 15, byte >> 4).to(tl.float32)
        return _f16_at(base, nm) * sc * nib - _f16_at(base + 2, nm) * mn

    @triton.jit
    def _dequant_block(row, kb, i, nm, QTYPE: tl.constexpr, BLOCK_BYTES: tl.constexpr):
        """Block kb (32 weights) of the rows at byte pointers `row`, [BLOCK_N, 32] float32."""
        if QTYPE == 8:
            w = _q8_0_block(row + kb * BLOCK_BYTES, i, nm)
        elif QTYPE == 2:
            w = _q4_0_block(row + kb * BLOCK_BYTES, i, nm)
        elif QTYPE == 3:
            w = _q4_1_block(row + kb * BLOCK_BYTES, i, nm)
        elif QTYPE == 39:
            w = _mxfp4_block(row + kb * BLOCK_BYTES, i, nm)
        elif QTYPE == 12:
            w = _q4_k_block(row, kb, i, nm, BLOCK_BYTES)
        else:  # I8: int8 values, per-row scale applied at the end
            q = tl.load(row + kb * 32 + i, mask=nm, other=0).to(tl.int8, bitcast=True)
            w = q.to(tl.float32)
        return w

    @triton.jit
    def _quant_linear_kernel(
        x_ptr, w_ptr, s_ptr, y_ptr, M, N, K,
        stride_xm, stride_wn, stride_ym,
        QTYPE: tl.constexpr, BLOCK_BYTES: tl.constexpr, SUPER: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok = rm < M
        n_ok = rn < N
        nm = n_ok[:, None]
        i = tl.arange(0, 32)[None, :]  # element within a 32-block
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        row = w_ptr + rn[:, None].to(tl.int64) * stride_wn  # [BLOCK_N, 1] byte pointers
        for kb in range(0, K // 32):
            w = _dequant_block(row, kb, i, nm, QTYPE, BLOCK_BYTES)
            xk = tl.load(
                x_ptr + rm[:, None] * stride_xm + kb * 32 + i, mask=m_ok[:, None], other=0.0
            )
            acc += tl.dot(xk, tl.trans(w), input_precision="ieee")
        if QTYPE == 100:
            acc = acc * tl.load(s_ptr + rn, mask=n_ok, other=0.0)[None, :]
        tl.store(
            y_ptr + rm[:, None] * stride_ym + rn[None, :], acc, mask=m_ok[:, None] & n_ok[None, :]
        )
