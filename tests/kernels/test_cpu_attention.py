"""The native CPU decode-attention path against the torch reference."""

from __future__ import annotations

import pytest
import torch

from kvserve.kernels import cpu
from kvserve.kernels.attention_cpu import paged_attention_cpu
from kvserve.kernels.attention_ref import paged_attention_ref


def _case(dtype, num_reqs, query_lens, seed=0):
    torch.manual_seed(seed)
    block_size, num_kv_heads, num_heads, head_size = 16, 3, 9, 64
    max_blocks = 24
    num_blocks = num_reqs * max_blocks + 1
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_size, dtype=dtype)
    value_cache = torch.randn_like(key_cache)
    block_table = (
        torch.randperm(num_blocks - 1)[: num_reqs * max_blocks].view(num_reqs, max_blocks).int() + 1
    )
    seq_lens = torch.tensor(
        [
            max(q, int(s))
            for q, s in zip(query_lens, torch.randint(1, max_blocks * block_size, (num_reqs,)))
        ],
        dtype=torch.int32,
    )
    query_start_loc = torch.zeros(num_reqs + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.tensor(query_lens).cumsum(0)
    # q as a strided slice of a fused qkv output, as the model passes it.
    qkv = torch.randn(
        int(query_start_loc[-1]), num_heads + 2 * num_kv_heads, head_size, dtype=dtype
    )
    return (
        qkv[:, :num_heads],
        key_cache,
        value_cache,
        block_table,
        query_start_loc,
        seq_lens,
        head_size**-0.5,
        max(query_lens),
        int(seq_lens.max()),
    )


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("query_lens", [[1] * 37, [1, 5, 1, 1, 17, 1], [9, 3]])
def test_cpu_path_matches_reference(dtype, atol, query_lens):
    if not cpu.available(dtype):
        pytest.skip("no C compiler here: the CPU path is the torch reference itself")
    args = _case(dtype, len(query_lens), query_lens)
    expected = paged_attention_ref(*args)
    got = paged_attention_cpu(*args)
    torch.testing.assert_close(got.float(), expected.float(), atol=atol, rtol=atol)


def test_kernel_builds_on_this_machine():
    # CI machines have a C compiler: the fast path must actually be taken there.
    assert cpu.available(torch.float32)


def test_dispatch_picks_the_native_kernel_or_the_reference(monkeypatch):
    from kvserve import kernels
    from kvserve.kernels import attention_cpu, attention_ref

    calls = []
    monkeypatch.setattr(
        attention_cpu,
        "paged_attention_cpu",
        lambda *a: calls.append("cpu") or paged_attention_cpu(*a),
    )
    monkeypatch.setattr(
        attention_ref,
        "paged_attention_ref",
        lambda *a: calls.append("ref") or paged_attention_ref(*a),
    )
    args = _case(torch.float32, 3, [1, 4, 1])
    kernels.paged_attention(*args)
    monkeypatch.setattr(cpu, "available", lambda dtype: False)
    kernels.paged_attention(*args)
    assert calls == ["cpu", "ref"]


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("query_lens", [[1] * 13, [1, 5, 1, 17]])
@pytest.mark.parametrize("sliding_window,soft_cap", [(40, None), (16, None), (None, 5.0), (33, 2)])
def test_cpu_path_window_and_soft_cap_match_reference(
    dtype, atol, query_lens, sliding_window, soft_cap
):
    if not cpu.available(dtype):
        pytest.skip("no C compiler here: the CPU path is the torch reference itself")
    args = (*_case(dtype, len(query_lens), query_lens), sliding_window, soft_cap)
    expected = paged_attention_ref(*args)
    got = paged_attention_cpu(*args)
    torch.testing.assert_close(got.float(), expected.float(), atol=atol, rtol=atol)
    plain = paged_attention_ref(*args[:-2])
    assert not torch.allclose(got.float(), plain.float(), atol=1e-2)


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("query_lens", [[1] * 13, [1, 5, 1, 17], [40, 3], [100, 1]])
@pytest.mark.parametrize("sliding_window", [None, 33])
def test_cpu_path_sinks_match_reference(dtype, atol, query_lens, sliding_window, monkeypatch):
    # Decodes and prefill chunks against the reference's softmax with the sink column: chunks
    # through the decode kernel (a query per token) and, without a window, through the flash
    # route too (torch's flash, the sink applied from its log-sum-exps: long float32 chunks
    # behind a context, bfloat16 ones past the decode kernel's limit).
    flash_chunks = _count_flash_calls(monkeypatch)
    if not cpu.available(dtype):
        pytest.skip("no C compiler here: the CPU path is the torch reference itself")
    case = _case(dtype, len(query_lens), query_lens)
    num_heads = case[0].shape[1]
    sinks = torch.randn(num_heads, generator=torch.Generator().manual_seed(3)) * 2.0
    args = (*case, sliding_window, None)
    expected = paged_attention_ref(*args, sinks=sinks)
    got = paged_attention_cpu(*args, sinks=sinks)
    torch.testing.assert_close(got.float(), expected.float(), atol=atol, rtol=atol)
    plain = paged_attention_ref(*case, sliding_window)
    assert not torch.allclose(got.float(), plain.float(), atol=1e-2)
    if sliding_window is None and query_lens[0] == 100:
        from kvserve.kernels import prefill_route

        limit = prefill_route.decode_kernel_max_query_len(dtype, num_heads, 3, 64)
        seq_len = int(case[5][0])
        takes_flash = not prefill_route.prefill_in_decode_kernel(dtype, 100, seq_len, limit)
        assert flash_chunks == ([0] if takes_flash else []), (flash_chunks, seq_len, limit)


def _count_flash_calls(monkeypatch) -> list[int]:
    """A list that grows by one per chunk paged_attention_cpu sends down the flash route (AMX
    tiles where the CPU has them, else torch's flash; the calls go on)."""
    from kvserve.kernels import attention_cpu

    calls: list[int] = []
    real_chunks = attention_cpu.prefill_chunks

    def counting_chunks(*args, **kwargs):
        calls.extend(args[7])  # reqs
        return real_chunks(*args, **kwargs)

    monkeypatch.setattr(attention_cpu, "prefill_chunks", counting_chunks)
    return calls


@pytest.mark.parametrize("amx", [False, True], ids=["no-amx", "amx"])
@pytest.mark.parametrize(
    "dtype, atol, query_len, seq_len, flash_without_amx, flash_with_amx",
    [
        (torch.float32, 1e-5, 300, 300, False, False),  # a first chunk: the decode kernel
        (torch.float32, 1e-5, 100, 300, True, True),  # behind a context: flash
        (torch.float32, 1e-5, 600, 600, True, True),  # a long first chunk: flash
        # bfloat16: the decode kernel up to 1024 keys, but with AMX (the flash route runs
        # on its tiles) only for chunks of under 64 tokens.
        (torch.bfloat16, 2e-2, 100, 300, False, True),
        (torch.bfloat16, 2e-2, 600, 600, False, True),
        (torch.bfloat16, 2e-2, 32, 300, False, False),
        (torch.bfloat16, 2e-2, 200, 1100, True, True),  # over 1024 keys: flash
    ],
)
def test_prefill_chunk_takes_its_route_and_matches_reference(
    monkeypatch, amx, dtype, atol, query_len, seq_len, flash_without_amx, flash_with_amx
):
    # Both routes run on any CPU (AMX changes only which is faster), so the rule for a CPU
    # with AMX and the rule for one without are each checked here, whatever this CPU is.
    if not cpu.available(dtype):
        pytest.skip("no C compiler here: the CPU path is the torch reference itself")

    monkeypatch.setattr(cpu, "cpu_has_amx", lambda: amx)
    through_flash = flash_with_amx if amx else flash_without_amx
    flash_calls = _count_flash_calls(monkeypatch)
    torch.manual_seed(1)
    block_size, num_kv_heads, num_heads, head_size = 16, 3, 9, 64
    query_lens, seq_lens = [1, query_len, 1], [50, seq_len, 70]
    max_blocks = -(-max(seq_lens) // block_size)
    num_blocks = len(seq_lens) * max_blocks + 1
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_size, dtype=dtype)
    value_cache = torch.randn_like(key_cache)
    block_table = torch.randperm(num_blocks - 1).view(len(seq_lens), max_blocks).int() + 1
    query_start_loc = torch.tensor([0] + query_lens).cumsum(0).int()
    qkv = torch.randn(sum(query_lens), num_heads + 2 * num_kv_heads, head_size, dtype=dtype)
    args = (
        qkv[:, :num_heads],
        key_cache,
        value_cache,
        block_table,
        query_start_loc,
        torch.tensor(seq_lens, dtype=torch.int32),
        head_size**-0.5,
        query_len,
        max(seq_lens),
    )
    expected = paged_attention_ref(*args)
    got = paged_attention_cpu(*args)
    torch.testing.assert_close(got.float(), expected.float(), atol=atol, rtol=atol)
    assert bool(flash_calls) == through_flash


def test_fit_prefill_limit_keeps_the_lengths_the_decode_kernel_wins():
    from kvserve.kernels.prefill_route import fit_prefill_limit

    assert fit_prefill_limit({32: (1.0, 2.0), 64: (2.0, 2.5), 128: (4.0, 3.0)}) == 64
    # A tie keeps the decode kernel; a loss stops there even where it wins again later.
    assert fit_prefill_limit({32: (1.0, 1.0), 64: (3.0, 2.0), 128: (1.0, 9.0)}) == 32
    # Lost at the shortest probe: shorter chunks (a verify step's 1 + k) keep it.
    assert fit_prefill_limit({32: (2.0, 1.0)}) == 31
    assert fit_prefill_limit({n: (1.0, 2.0) for n in (32, 64, 128, 256, 512, 1024)}) == 1024


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_measured_prefill_route_sends_chunks_by_the_measured_limit(monkeypatch, dtype):
    # Timed on this CPU (the product default; tests/conftest.py keeps engines on the fixed
    # defaults): whatever the limit, a first chunk up to it takes the decode kernel and one
    # past it flash, both matching the reference.
    if not cpu.available(dtype):
        pytest.skip("no C compiler here: the CPU path is the torch reference itself")
    from kvserve.kernels import cpu_prefill, prefill_route

    heads = (9, 3, 64)
    monkeypatch.setattr(prefill_route, "_DECODE_KERNEL_MAX_QUERY_LEN", {})
    monkeypatch.setattr(cpu_prefill, "FLASH_ROUTE", {})
    limit, timings = prefill_route.measure_prefill_route(dtype, *heads, block_size=16, rounds=1)
    assert limit == prefill_route.fit_prefill_limit(timings)
    # The start-up log names what ran the flash side: AMX tiles for bfloat16 where there are.
    amx = dtype == torch.bfloat16 and cpu.cpu_has_amx()
    assert cpu_prefill.FLASH_ROUTE == {(dtype, *heads): "AMX tiles" if amx else "torch's flash"}
    assert list(timings) == list(prefill_route.PREFILL_PROBE_LENS[: len(timings)])
    assert all(d > 0 and f > 0 for d, f in timings.values())
    assert prefill_route.decode_kernel_max_query_len(dtype, *heads) == limit
    flash_calls = _count_flash_calls(monkeypatch)
    # Pin the limit at 40 so both sides of it are cheap to run.
    prefill_route._DECODE_KERNEL_MAX_QUERY_LEN[(dtype, *heads)] = 40
    torch.manual_seed(2)
    for query_len, through_flash in ((40, False), (41, True)):
        flash_calls.clear()
        key_cache = torch.randn(5, 16, 3, 64, dtype=dtype)
        value_cache = torch.randn_like(key_cache)
        args = (
            torch.randn(query_len, 9, 64, dtype=dtype),
            key_cache,
            value_cache,
            torch.tensor([[1, 2, 3, 4]], dtype=torch.int32),
            torch.tensor([0, query_len], dtype=torch.int32),
            torch.tensor([query_len], dtype=torch.int32),
            64**-0.5,
            query_len,
            query_len,
        )
        got = paged_attention_cpu(*args)
        torch.testing.assert_close(
            got.float(), paged_attention_ref(*args).float(), atol=2e-2, rtol=2e-2
        )
        assert bool(flash_calls) == through_flash


needs_amx = pytest.mark.skipif(
    not cpu.cpu_has_amx(), reason="needs AMX tiles (a Sapphire Rapids or later): this CPU has none"
)


@needs_amx
@pytest.mark.parametrize(
    "num_heads, num_kv_heads, head_size, block_size, chunks",
    [
        # (query_len, seq_len) per request; query_len 1 are decodes the call leaves alone.
        (9, 3, 64, 16, [(256, 256)]),
        (9, 3, 64, 16, [(17, 17), (1, 40), (33, 100), (100, 1000), (1, 9)]),
        (8, 8, 128, 16, [(64, 64), (31, 77)]),
        (4, 1, 256, 32, [(40, 40), (5, 300)]),
        (6, 2, 64, 1, [(50, 50), (47, 80)]),
    ],
)
def test_amx_prefill_matches_reference(num_heads, num_kv_heads, head_size, block_size, chunks):
    # The kernel itself, every chunk of a step in one call: GQA groups, head sizes 64 (O^T kept
    # in tiles) and 128 / 256 (two halves side by side), chunks behind a context, lengths off
    # the 16-row and 32-key grid, block sizes 1, 16 and 32, q a strided slice of qkv.
    torch.manual_seed(3)
    dtype = torch.bfloat16
    query_lens, seq_lens = [q for q, _ in chunks], [s for _, s in chunks]
    max_blocks = max(-(-s // block_size) for s in seq_lens)
    num_blocks = len(chunks) * max_blocks + 1
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_size, dtype=dtype)
    value_cache = torch.randn_like(key_cache)
    block_table = torch.randperm(num_blocks - 1).view(len(chunks), max_blocks).int() + 1
    query_start_loc = torch.tensor([0] + query_lens).cumsum(0).int()
    qkv = torch.randn(sum(query_lens), num_heads + 2 * num_kv_heads, head_size, dtype=dtype)
    query = qkv[:, :num_heads]
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    scale = head_size**-0.5
    out = torch.full_like(query, float("nan"))
    prefill = [r for r, q in enumerate(query_lens) if q > 1]
    args = (key_cache, value_cache, block_table, query_start_loc, lens)
    assert cpu.prefill_attention_amx(out, query, *args, prefill, scale)
    expected = paged_attention_ref(query, *args, scale, max(query_lens), max(seq_lens))
    for r in range(len(chunks)):
        rows = slice(int(query_start_loc[r]), int(query_start_loc[r + 1]))
        if r in prefill:
            torch.testing.assert_close(
                out[rows].float(), expected[rows].float(), atol=2e-2, rtol=2e-2
            )
        else:  # not asked for: untouched
            assert out[rows].isnan().all()


@needs_amx
def test_amx_prefill_refuses_what_it_does_not_cover():
    # A head size off its 64 grid: False, nothing written, and the caller keeps torch's flash.
    torch.manual_seed(4)
    key_cache = torch.randn(3, 16, 2, 96, dtype=torch.bfloat16)
    query = torch.randn(20, 4, 96, dtype=torch.bfloat16)
    out = torch.zeros_like(query)
    args = (
        key_cache,
        torch.randn_like(key_cache),
        torch.tensor([[1, 2]], dtype=torch.int32),
        torch.tensor([0, 20], dtype=torch.int32),
        torch.tensor([20], dtype=torch.int32),
    )
    assert not cpu.prefill_attention_amx(out, query, *args, [0], 96**-0.5)
    assert not out.any()
    got = paged_attention_cpu(query, *args, 96**-0.5, 20, 20)
    expected = paged_attention_ref(query, *args, 96**-0.5, 20, 20)
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)
