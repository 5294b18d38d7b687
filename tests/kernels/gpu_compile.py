"""Compile every Triton kernel down to a CUDA cubin, no GPU needed.

The interpreter accepts code the compiler rejects (non-constexpr shapes, bad dtype mixes), so
passing the interpreter tests is not enough. Triton's CUDA backend ships ptxas, so the full
pipeline (ttir -> ttgir -> llir -> ptx -> cubin) runs on a CPU-only machine.

Run with TRITON_INTERPRET unset (test_gpu_compile.py starts it in a subprocess):
    python -m tests.kernels.gpu_compile
"""

from __future__ import annotations

import os
import sys

assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), "unset TRITON_INTERPRET first"

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kvserve.kernels import activation, attention, cache, norm, rotary  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)  # Hopper (H100 / H200)

# Pointer arguments that hold indices (or float32 parameters), not activations.
_INDEX_POINTERS = {
    "positions_ptr": "*i64",
    "slot_mapping_ptr": "*i64",
    "block_table_ptr": "*i32",
    "query_start_loc_ptr": "*i32",
    "seq_lens_ptr": "*i32",
    "cos_sin_ptr": "*fp32",
    "sinks_ptr": "*fp32",
}
_FLOAT_SCALARS = {"eps", "scale"}


def _signature(kernel, dtype: str, constexprs: dict) -> dict[str, str]:
    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in _INDEX_POINTERS:
            signature[name] = _INDEX_POINTERS[name]
        elif name.endswith("_ptr"):
            signature[name] = f"*{dtype}"
        elif name in _FLOAT_SCALARS:
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
    return signature


def compile_kernel(kernel, dtype: str, **constexprs) -> None:
    """Compile one kernel for TARGET with the given activation dtype and constexprs."""
    source = ASTSource(
        fn=kernel, signature=_signature(kernel, dtype, constexprs), constexprs=constexprs
    )
    compiled = triton.compile(source, target=TARGET)
    assert compiled.asm.get("cubin"), f"{kernel.__name__}: no cubin"


def main() -> int:
    attention_constexprs = dict(
        NUM_QUERIES_PER_KV=3, HEAD_SIZE=64, BLOCK_HEAD=64, BLOCK_SIZE=16, TILE_N=32
    )
    jobs = [
        (norm._rms_norm_kernel, "bf16", dict(HAS_RESIDUAL=True, BLOCK_SIZE=1024)),
        (norm._rms_norm_kernel, "fp32", dict(HAS_RESIDUAL=False, BLOCK_SIZE=1024)),
        (activation._silu_and_mul_kernel, "bf16", dict(BLOCK_SIZE=1024)),
        (
            rotary._rotary_embedding_kernel,
            "bf16",
            dict(HEAD_SIZE=64, BLOCK_QUERY_HEADS=16, BLOCK_KV_HEADS=4, BLOCK_HALF=32),
        ),
        (cache._write_kv_cache_kernel, "bf16", dict(BLOCK_SIZE=256)),
        (
            attention._paged_attention_kernel,
            "bf16",
            dict(attention_constexprs, BLOCK_M=16, BLOCK_Q=5, DOT_PRECISION="tf32"),
        ),
        (
            attention._paged_attention_kernel,
            "fp32",
            dict(attention_constexprs, BLOCK_M=64, BLOCK_Q=21, DOT_PRECISION="ieee"),
        ),
        # The JIT turns int arguments equal to 1 into constexprs: one request is common, and
        # num_reqs seeds a loop-carried variable of the binary search.
        (
            attention._paged_attention_kernel,
            "bf16",
            dict(attention_constexprs, BLOCK_M=64, BLOCK_Q=21, DOT_PRECISION="tf32", num_reqs=1),
        ),
        # gpt-oss: attention sinks beside a sliding window.
        (
            attention._paged_attention_kernel,
            "bf16",
            dict(
                attention_constexprs,
                BLOCK_M=16,
                BLOCK_Q=5,
                DOT_PRECISION="tf32",
                USE_WINDOW=True,
                USE_SOFT_CAP=False,
                USE_SINKS=True,
            ),
        ),
        (
            rotary._rotary_embedding_kernel,
            "fp32",
            dict(
                HEAD_SIZE=128, BLOCK_QUERY_HEADS=8, BLOCK_KV_HEADS=1, BLOCK_HALF=64, num_kv_heads=1
            ),
        ),
    ]
    for kernel, dtype, constexprs in jobs:
        compile_kernel(kernel, dtype, **constexprs)
        print(f"compiled {kernel.__name__} ({dtype}) for {TARGET.backend} sm_{TARGET.arch}")
    print(f"{len(jobs)} kernels compiled")
    return 0


if __name__ == "__main__":
    sys.exit(main())
