"""CPU GEMM paths (kernels/gemm.py): oneDNN's packed path matches F.linear, the plan picks a
path per row count, and plans are measured once per machine, then cached."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F

from kvserve import kernels
from kvserve.kernels import cpu, gemm

pytestmark = pytest.mark.skipif(not gemm.onednn_available(), reason="torch built without oneDNN")


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("rows", [1, 5, 64, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_onednn_path_matches_f_linear(dtype, tol, rows, with_bias):
    if not gemm.onednn_available(dtype):
        pytest.skip(
            f"oneDNN runs no {dtype} linear on this CPU (bfloat16 needs AVX-512 or AVX-NE-CONVERT)"
        )
    torch.manual_seed(rows)
    weight = torch.randn(96, 40, dtype=dtype)
    bias = torch.randn(96, dtype=dtype) if with_bias else None
    x = torch.randn(rows, 40, dtype=dtype)
    got = gemm.onednn_linear(x, gemm.pack_onednn(weight), bias)
    torch.testing.assert_close(got.float(), F.linear(x, weight, bias).float(), atol=tol, rtol=tol)


def test_plan_picks_the_rung_of_the_row_count(monkeypatch):
    plan = gemm.ShapePlan(("torch", "torch", "onednn", "onednn", "onednn", "torch"))
    assert [plan.path_for(r) for r in (1, 4, 5, 16, 200, 256, 257, 5000)] == [
        "torch",
        "torch",
        "onednn",
        "onednn",
        "onednn",
        "onednn",
        "torch",
        "torch",
    ]
    assert plan.describe() == "torch from 1, onednn from 16, torch from 1024"
    weight = torch.randn(8, 4)
    prepared = gemm.LinearWeights(plan, gemm.pack_onednn(weight))
    calls = []
    real = gemm.onednn_linear
    monkeypatch.setattr(gemm, "onednn_linear", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    for rows in (2, 20, 2000):
        kernels.linear(torch.randn(rows, 4), weight, None, prepared)
    assert calls == [20]


def test_non_contiguous_input_takes_the_onednn_path_correctly():
    weight = torch.randn(16, 8)
    prepared = gemm.LinearWeights(gemm.ShapePlan(("onednn",) * 6), gemm.pack_onednn(weight))
    x = torch.randn(8, 10)[:, 1:9]  # a strided view, as a slice of a fused output
    torch.testing.assert_close(kernels.linear(x, weight, None, prepared), F.linear(x, weight))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_a_residual_add_fused_into_the_onednn_gemm(dtype, with_bias):
    """linear(..., add=residual) on the oneDNN path adds inside the GEMM: float32 bit for bit
    the unfused sum, bfloat16 within a rounding of it (one rounding fewer); on the other
    paths it adds afterwards. The plan says which rows fuse."""
    if not gemm.onednn_available(dtype):
        pytest.skip(f"oneDNN runs no {dtype} linear on this CPU")
    torch.manual_seed(0)
    weight = (torch.randn(96, 40) * 0.2).to(dtype)
    bias = torch.randn(96).to(dtype) if with_bias else None
    plan = gemm.ShapePlan(("torch", "torch", "onednn", "onednn", "onednn", "torch"))
    prepared = gemm.LinearWeights(plan, gemm.pack_onednn(weight))
    for rows, fused in ((3, False), (40, True), (2000, False)):
        x, residual = torch.randn(rows, 40).to(dtype), torch.randn(rows, 96).to(dtype)
        assert kernels.linear_fuses_add(x.device, prepared, rows) is fused
        got = kernels.linear(x, weight, bias, prepared, add=residual)
        unfused = kernels.linear(x, weight, bias, prepared) + residual
        if dtype == torch.float32:
            assert torch.equal(got, unfused)
        else:
            torch.testing.assert_close(got, unfused, atol=0.05, rtol=2**-7)
    assert not kernels.linear_fuses_add(torch.device("cpu"), None, 40)


def test_tune_measures_once_then_reuses_the_machines_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(gemm, "cpu_stall_us", lambda: 0)  # quiet cores, whatever else runs
    measured = []

    def fake_measure(dtype, n, k, max_rows):
        measured.append((n, k))
        return gemm.ShapePlan(("onednn" if n > 100 else "torch",) * 6)

    shapes = [(torch.float32, 960, 576, 2048), (torch.float32, 64, 576, 2048)] * 2
    first = gemm.tune(shapes, measure=fake_measure)
    assert first.source == "measured" and sorted(measured) == [(64, 576), (960, 576)]
    assert first.summary() == {"float32:64x576": "torch", "float32:960x576": "onednn"}
    second = gemm.tune(shapes, measure=fake_measure)
    assert second.source == "cached" and len(measured) == 2
    assert second.summary() == first.summary()
    # Another thread count is another machine as far as the plan goes.
    monkeypatch.setattr(torch, "get_num_threads", lambda: 7)
    assert gemm.tune(shapes, measure=fake_measure).source == "measured"


def test_forced_modes_measure_nothing_and_unknown_modes_are_refused():
    def never(*args):
        raise AssertionError("measured")

    plan = gemm.tune([(torch.float32, 8, 4, 16)], mode="onednn", measure=never)
    assert plan.source == "forced" and plan.summary() == {"float32:8x4": "onednn"}
    with pytest.raises(ValueError, match="unknown GEMM path"):
        gemm.tune([(torch.float32, 8, 4, 16)], mode="mkl", measure=never)


def test_measure_shape_returns_a_path_per_rung():
    plan = gemm.measure_shape(torch.float32, 32, 16, max_rows=16, seconds_per_rung=0.003)
    assert len(plan.paths) == len(gemm.ROW_LADDER) and set(plan.paths) <= set(gemm.PATHS)
    # Rungs above max_rows copy the last measured one.
    assert plan.paths[3:] == (plan.paths[2],) * 3


@pytest.fixture
def quick_settle(monkeypatch):
    """Contended shapes are measured again after 10 ms, three times at most."""
    monkeypatch.setattr(gemm, "SETTLE_S", 0.01)
    monkeypatch.setattr(gemm, "SETTLE_BUDGET_S", 0.03)


def test_a_plan_measured_on_contended_cores_serves_but_is_not_cached(
    tmp_path, monkeypatch, quick_settle
):
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    measured = []

    def fake_measure(dtype, n, k, max_rows):
        measured.append((n, k))
        stall_us[0] += stall_per_shape_us  # other work waiting for the cores meanwhile
        return gemm.ShapePlan(("onednn",) * 6)

    stall_us = [0]
    monkeypatch.setattr(gemm, "cpu_stall_us", lambda: stall_us[0])
    shapes = [(torch.float32, 960, 576, 2048)]
    stall_per_shape_us = 10**9  # every measuring second stalled: contended
    first = gemm.tune(shapes, measure=fake_measure)
    assert first.source == "measured" and first.stalled_share == 1.0 and first.contended == 1
    assert len(measured) == 4  # measured, then again after each of three waits
    assert first.summary() == {"float32:960x576": "onednn"}  # used for this start
    assert gemm.tune(shapes, measure=fake_measure).source == "measured"  # not cached
    assert len(measured) == 8
    stall_per_shape_us = 0  # a quiet machine: the plan is kept
    assert gemm.tune(shapes, measure=fake_measure).stalled_share == 0.0
    assert gemm.tune(shapes, measure=fake_measure).source == "cached"
    assert len(measured) == 9


def test_a_start_up_burst_on_the_cores_is_waited_out_and_the_plan_cached(
    tmp_path, monkeypatch, quick_settle
):
    # On two cores the engine's own processes (the api's imports) start beside the worker's
    # tuning: every start measured its first shape contended, stopped, ran torch's path on
    # the rest and cached nothing. The burst passes: the shape is measured again, quietly.
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    measured = []
    stall_us = [0]

    def fake_measure(dtype, n, k, max_rows):
        measured.append(n)
        if len(measured) == 1:
            stall_us[0] += 10**9  # the first measurement shares the cores
        return gemm.ShapePlan(("onednn",) * 6)

    monkeypatch.setattr(gemm, "cpu_stall_us", lambda: stall_us[0])
    shapes = [(torch.float32, n, 576, 2048) for n in (64, 960, 1536)]
    plan = gemm.tune(shapes, measure=fake_measure)
    assert measured == [64, 64, 960, 1536]
    assert plan.contended == 0 and plan.unmeasured == 0
    assert set(plan.summary().values()) == {"onednn"}
    assert gemm.tune(shapes, measure=lambda *a: 1 / 0).source == "cached"


def test_measuring_stops_once_the_cores_stay_contended(tmp_path, monkeypatch, quick_settle):
    # Three engines of one machine measuring at once took a minute each, every start: a
    # shape still contended after the waits ends the measuring and the rest run torch
    # (nothing cached).
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    measured = []
    stall_us = [0]

    def fake_measure(dtype, n, k, max_rows):
        measured.append(n)
        stall_us[0] += 10**9  # every measuring second stalled
        time.sleep(0.01)
        return gemm.ShapePlan(("onednn",) * 6)

    monkeypatch.setattr(gemm, "cpu_stall_us", lambda: stall_us[0])
    shapes = [(torch.float32, n, 576, 2048) for n in (64, 960, 1536)]
    plan = gemm.tune(shapes, measure=fake_measure)
    assert measured == [64] * 4 and plan.unmeasured == 2
    assert plan.summary() == {
        "float32:1536x576": "torch",
        "float32:64x576": "onednn",
        "float32:960x576": "torch",
    }
    stall_us[0] = 0
    monkeypatch.setattr(gemm, "cpu_stall_us", lambda: 0)  # quiet: all measured, cached
    assert gemm.tune(shapes, measure=fake_measure).unmeasured == 0
    assert measured == [64] * 5 + [960, 1536]
    assert gemm.tune(shapes, measure=fake_measure).source == "cached"


def test_shapes_left_unmeasured_take_the_nearest_quiet_same_dtype_plan(
    tmp_path, monkeypatch, quick_settle
):
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    stall_us = [0]
    measured = []

    def fake_measure(dtype, n, k, max_rows):
        measured.append(n)
        if n == 960:
            stall_us[0] += 10**9  # the cores stay contended from the second shape on
        return gemm.ShapePlan(("native",) + ("onednn",) * 5 if n == 64 else ("onednn",) * 6)

    monkeypatch.setattr(gemm, "cpu_stall_us", lambda: stall_us[0])
    shapes = [(torch.float32, n, 576, 2048) for n in (64, 960, 1536, 3072)]
    plan = gemm.tune(shapes, measure=fake_measure)
    assert measured == [64] + [960] * 4  # 1536 and 3072 left unmeasured
    assert plan.contended == 1 and plan.unmeasured == 2
    summary = plan.summary()
    quiet = "native from 1, onednn from 4"
    assert summary["float32:64x576"] == quiet  # measured quietly
    assert summary["float32:960x576"] == "onednn"  # its contended measurement, this start
    assert summary["float32:1536x576"] == summary["float32:3072x576"] == quiet
    cached = gemm.tune(shapes[:1], measure=lambda *a: 1 / 0)  # the quiet shape was cached
    assert cached.source == "cached" and cached.summary()["float32:64x576"] == quiet


def test_without_pressure_stall_information_plans_are_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(gemm, "_PSI_CPU", str(tmp_path / "no-psi"))
    assert gemm.cpu_stall_us() is None
    shapes = [(torch.float32, 64, 576, 2048)]
    plan = gemm.tune(shapes, measure=lambda *a: gemm.ShapePlan(("torch",) * 6))
    assert plan.stalled_share is None
    assert gemm.tune(shapes, measure=lambda *a: 1 / 0).source == "cached"


def test_cpu_stall_us_reads_the_some_line(tmp_path, monkeypatch):
    psi = tmp_path / "cpu"
    psi.write_text(
        "some avg10=0.04 avg60=3.92 avg300=5.19 total=10102771845\n"
        "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
    )
    monkeypatch.setattr(gemm, "_PSI_CPU", str(psi))
    assert gemm.cpu_stall_us() == 10102771845


def test_a_dtype_onednn_cannot_run_here_stays_on_torch(monkeypatch):
    """On a CPU without oneDNN's bfloat16 (AVX2 only) and without the native kernels,
    bfloat16 shapes are never measured or forced onto oneDNN: packing their weights would
    fail."""
    monkeypatch.setattr(
        gemm, "onednn_available", lambda dtype=torch.float32: dtype != torch.bfloat16
    )
    monkeypatch.setattr(gemm, "native_available", lambda dtype: False)
    monkeypatch.setattr(gemm, "widened_available", lambda dtype: False)
    measured = []

    def fake_measure(dtype, n, k, max_rows):
        measured.append(dtype)
        return gemm.ShapePlan(("onednn",) * len(gemm.ROW_LADDER))

    shapes = [(torch.float32, 8, 4, 16), (torch.bfloat16, 8, 4, 16)]
    plan = gemm.tune(shapes, use_cache=False, measure=fake_measure)
    assert measured == [torch.float32]
    assert plan.summary() == {"bfloat16:8x4": "torch", "float32:8x4": "onednn"}
    forced = gemm.tune(shapes, mode="onednn")
    assert forced.summary() == {"bfloat16:8x4": "torch", "float32:8x4": "onednn"}


native = pytest.mark.skipif(
    not gemm.native_available(torch.float32), reason="the native kernels need a C compiler"
)


@native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 33])
def test_native_path_matches_f_linear(dtype, rows):
    torch.manual_seed(rows)
    weight = torch.randn(70, 40, dtype=dtype) / 40**0.5  # N not a multiple of 4, K of 8
    bias = torch.randn(70, dtype=dtype)
    x = torch.randn(rows, 40, dtype=dtype)
    got = gemm.native_linear(x, weight, bias)
    want = torch.nn.functional.linear(x.float(), weight.float(), bias.float())
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.03, rtol=0.01)
    assert got.dtype == dtype and got.shape == (rows, 70)
    torch.testing.assert_close(got.float(), want, **tol)
    batched = gemm.native_linear(x.view(1, rows, 40), weight, None)
    torch.testing.assert_close(batched[0].float(), want - bias.float(), **tol)


@native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [37, 41])
def test_each_native_row_is_the_same_whatever_shares_its_call(dtype, n):
    # The decode stack's promise (greedy with speculation equals greedy without) rests on
    # this: a row's output does not depend on M nor on the row's place among the others. N
    # odd (with AVX-512, blocks of six W rows: 37 ends in one row, 41 in five, through the
    # four-row tile) and K = 16 * 3 + 8 + 3 reach every tile, the last 8-chunk and the
    # scalar tail.
    torch.manual_seed(5)
    weight = torch.randn(n, 59, dtype=dtype)
    x = torch.randn(7, 59, dtype=dtype)
    alone = [gemm.native_linear(x[i : i + 1], weight, None) for i in range(7)]
    for rows in range(2, 8):
        for start in range(8 - rows):
            together = gemm.native_linear(x[start : start + rows], weight, None)
            for i in range(rows):
                assert torch.equal(together[i : i + 1], alone[start + i]), (rows, start, i)


@native
def test_a_plan_naming_native_runs_the_native_gemv(monkeypatch):
    weight = torch.randn(12, 16)
    prepared = gemm.LinearWeights(gemm.ShapePlan(("native",) + ("torch",) * 5))
    calls = []
    real = gemm.native_linear
    monkeypatch.setattr(gemm, "native_linear", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    for rows in (1, 9):
        x = torch.randn(rows, 16)
        torch.testing.assert_close(gemm.linear(x, weight, None, prepared), x @ weight.T)
    assert calls == [1]


@native
def test_measuring_never_picks_a_path_that_cannot_run_the_dtype(monkeypatch):
    monkeypatch.setattr(
        gemm, "onednn_available", lambda dtype=torch.float32: dtype != torch.bfloat16
    )
    plan = gemm.measure_shape(torch.bfloat16, 64, 32, 16, seconds_per_rung=0.003)
    assert set(plan.paths) <= {"torch", "native", "widened"}  # no onednn
    forced = gemm.tune([(torch.bfloat16, 64, 32, 16)], mode="native")
    assert forced.summary() == {"bfloat16:64x32": "native"}


def test_the_start_up_log_names_the_cpus_isa_and_whether_it_has_amx():
    # /proc/cpuinfo's flags say whether the CPU has AMX tiles (a Sapphire Rapids does; an AMD
    # EPYC does not): the log line must agree, not read a torch attribute that is not there.
    with open("/proc/cpuinfo") as f:
        flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    isa, amx = cpu.cpu_isa().split(", ")
    assert isa == torch.backends.cpu.get_cpu_capability()
    assert amx == ("AMX" if "amx_tile" in flags else "no AMX")


@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_widened_path_matches_a_float32_reference(rows, with_bias):
    """bfloat16 weights computed in float32: the float32 product of the same bfloat16 values,
    rounded once to bfloat16."""
    torch.manual_seed(rows)
    weight = (torch.randn(96, 40) / 40**0.5).to(torch.bfloat16)
    bias = torch.randn(96).to(torch.bfloat16) if with_bias else None
    x = torch.randn(rows, 40).to(torch.bfloat16)
    got = gemm.widened_linear(x, weight, bias)
    want = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 96)
    torch.testing.assert_close(got.float(), want, atol=1e-6, rtol=2**-8)
    # A strided input (a slice of a fused output) and a smaller weight reuse the scratch.
    x_wide = torch.randn(rows, 48).to(torch.bfloat16)
    small = weight[:24].contiguous()
    torch.testing.assert_close(
        gemm.widened_linear(x_wide[:, 4:44], small, None).float(),
        F.linear(x_wide[:, 4:44].float(), small.float()),
        atol=1e-6,
        rtol=2**-8,
    )


def test_a_plan_naming_widened_runs_it_for_its_rows_only(monkeypatch):
    weight = torch.randn(12, 16).to(torch.bfloat16)
    prepared = gemm.LinearWeights(gemm.ShapePlan(("torch",) * 2 + ("widened",) * 4))
    calls = []
    real = gemm.widened_linear
    monkeypatch.setattr(gemm, "widened_linear", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    for rows in (3, 40):
        x = torch.randn(rows, 16).to(torch.bfloat16)
        got = gemm.linear(x, weight, None, prepared, add=torch.ones(rows, 12, dtype=torch.bfloat16))
        want = F.linear(x.float(), weight.float()) + 1
        torch.testing.assert_close(got.float(), want, atol=0.05, rtol=2**-7)
    assert calls == [40]
    assert gemm.tune([(torch.float32, 12, 16, 64)], mode="widened").summary() == {
        "float32:12x16": "torch"  # widened computes bfloat16 layers only
    }


@pytest.mark.parametrize("bf16_dot", [False, True])
def test_shapes_left_unmeasured_take_widened_where_bfloat16_is_emulated(
    tmp_path, monkeypatch, bf16_dot, quick_settle
):
    # A CPU without a bfloat16 dot product (AVX-512 but no AVX512-BF16, AVX2 only): torch's
    # bfloat16 GEMM is oneDNN's emulation, 4-6x slower than float32 on prefill rows; a start
    # on contended cores must not leave bfloat16 layers there.
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(gemm, "cpu_has_bf16_dot", lambda: bf16_dot)
    stall_us = [0]

    def fake_measure(dtype, n, k, max_rows):
        stall_us[0] += 10**9  # contended from the first shape on
        return gemm.ShapePlan(("onednn",) * 6)

    monkeypatch.setattr(gemm, "cpu_stall_us", lambda: stall_us[0])
    shapes = [(torch.bfloat16, n, 576, 2048) for n in (64, 960)] + [(torch.float32, 960, 576, 2048)]
    plan = gemm.tune(shapes, measure=fake_measure)
    assert plan.unmeasured == 2
    emulated = "torch from 1, widened from 16"
    assert plan.summary() == {
        "bfloat16:64x576": "onednn",
        "bfloat16:960x576": "torch" if bf16_dot else emulated,
        "float32:960x576": "torch",
    }


def test_cpu_has_bf16_dot_reads_the_flags(monkeypatch):
    cpu.cpu_has_bf16_dot.cache_clear()
    try:
        monkeypatch.setattr(cpu, "cpu_identity", lambda: "x86_64|Xeon|avx2 avx512f avx512_vnni")
        assert not cpu.cpu_has_bf16_dot()
        cpu.cpu_has_bf16_dot.cache_clear()
        monkeypatch.setattr(cpu, "cpu_identity", lambda: "x86_64|Xeon|avx512f avx512_bf16")
        assert cpu.cpu_has_bf16_dot()
    finally:
        cpu.cpu_has_bf16_dot.cache_clear()
