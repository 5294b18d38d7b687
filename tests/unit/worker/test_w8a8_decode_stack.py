"""W8A8 weights inside the native decode stack (kernels/decode_stack.py): the stack runs them
on csrc/w8a8.c's AMX-INT8 kernel (activations quantized per token) where that kernel runs, on
quant_gemm.c's I8 VNNI path when KVSERVE_W8A8_KERNEL=kvq; either way the same numbers as the
module path running that kernel, and each row's result whatever shares its step.

The tiny W8A8 checkpoint is the one llm-compressor wrote (tests/data/w8a8/, see
test_eight_bit_checkpoints.py).
"""

from __future__ import annotations

import pytest
import torch

from kvserve.kernels import decode_stack, w8a8
from kvserve.services.worker.models import load_model
from kvserve.services.worker.models.native_decode import bind_decode_stack
from tests.support.model_steps import bind_kv_caches, random_tokens, run_step
from tests.unit.worker.test_eight_bit_checkpoints import VOCAB, W8A8

pytestmark = pytest.mark.skipif(
    not decode_stack.available(torch.float32) or not decode_stack.quantized_available(),
    reason="needs the C CPU kernels (a C compiler)",
)
needs_amx = pytest.mark.skipif(not w8a8.amx_available(), reason="needs AMX-INT8")
NUM_BLOCKS = 72  # 4-token blocks: each request's 6 tokens in two, 33 requests at most


def _bound(dtype: torch.dtype, max_requests: int):
    model, _ = load_model(W8A8, dtype, "cpu", None)
    torch.set_default_dtype(dtype)  # bind_kv_caches allocates in the default dtype
    try:
        bind_kv_caches(model, num_blocks=NUM_BLOCKS)
    finally:
        torch.set_default_dtype(torch.float32)
    return model, bind_decode_stack(model, dtype, max_requests)


def _part_codes(model) -> set[int]:
    stack = model.model.decode_stack
    codes = set()
    for layer in stack._c_layers:
        for matrix in (layer.qkv, layer.o, layer.gate_up, layer.down):
            codes |= {matrix.parts[i].qtype for i in range(matrix.num_parts)}
    return codes


def _steps(num_requests: int):
    """A prefill of each request (the modules), then two decode steps of all of them."""
    prompts = [random_tokens(6, VOCAB, seed=300 + r) for r in range(num_requests)]
    blocks = [[2 * r, 2 * r + 1] for r in range(num_requests)]
    steps = [[(p[:4], 0, b) for p, b in zip(prompts, blocks)]]
    steps += [[([p[4 + i]], 4 + i, b) for p, b in zip(prompts, blocks)] for i in (0, 1)]
    return steps


@needs_amx
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w8a8_runs_the_amx_kernel_inside_the_stack_as_the_modules_do(dtype, monkeypatch):
    monkeypatch.setenv("KVSERVE_W8A8_KERNEL", "amx")  # the module path's kernel too
    native, status = _bound(dtype, 8)
    assert status.startswith("on"), status
    assert _part_codes(native) == {decode_stack.AMX_W8A8}
    modules, _ = _bound(dtype, 0)
    assert modules.model.decode_stack is None
    calls = []
    stack = native.model.decode_stack
    real_run = stack.run
    stack.run = lambda *args: calls.append(args[0].shape[0]) or real_run(*args)
    # bfloat16: both paths round each stage to bfloat16 the same way; a one-ulp difference
    # before a per-token quantization may move an int8 step (a 1/127 of the row's max)
    tol = dict(atol=1e-4, rtol=0) if dtype == torch.float32 else dict(atol=0.1, rtol=0.02)
    for requests in _steps(3):
        got = torch.cat(run_step(native, requests))
        want = torch.cat(run_step(modules, requests))
        torch.testing.assert_close(got, want, **tol)
    assert calls == [3, 3]  # the decode steps; the 4-token prefills ran the modules
    # the stack shares the module path's packed weight (packed once per weight)
    qkv = native.model.layers[0].self_attn.qkv_proj.quant_parts[0][1]
    packed = qkv.data.untyped_storage().__dict__["_kvserve_amx_packed"]
    assert len(packed) == 1


def test_forcing_kvq_keeps_the_i8_vnni_path_inside_the_stack(monkeypatch):
    monkeypatch.setenv("KVSERVE_W8A8_KERNEL", "kvq")
    native, status = _bound(torch.float32, 8)
    assert status.startswith("on"), status
    assert _part_codes(native) == {100}  # quant_gemm.c's I8 code
    modules, _ = _bound(torch.float32, 0)
    for requests in _steps(2):
        got = torch.cat(run_step(native, requests))
        want = torch.cat(run_step(modules, requests))
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


@needs_amx
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_rows_result_is_the_same_whatever_shares_its_step(dtype):
    # Row counts around the kernel's 16-row A tiles: 1, 15, 16, 17, 32, 33 requests decoded
    # together give each request bit for bit what it gets decoded alone.
    counts = (1, 15, 16, 17, 32, 33)
    together, status = _bound(dtype, max(counts))
    assert status.startswith("on") and together.model.decode_stack.amx, status
    alone, _ = _bound(dtype, 1)
    steps = _steps(max(counts))
    for model in (together, alone):
        run_step(model, steps[0])  # every request's prefill (the modules)
    want = [run_step(alone, [request])[0] for request in steps[1]]
    for count in counts:
        # each count's requests are new rows of the same step 1; rerun from the same cache
        rows = steps[1][:count]
        got = run_step(together, rows)
        for r in range(count):
            assert torch.equal(got[r], want[r]), (count, r)
