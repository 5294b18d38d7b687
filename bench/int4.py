"""4-bit checkpoints held quantized (W4G groups, kernels/int4.py) on the default model's
shapes and on the default model itself.

    .venv/bin/python bench/int4.py --kernels [--rounds 20]
        Per SmolLM2-135M layer shape and row count, the best of `rounds` calls (ms): the W4G64
        integer kernel (w4_linear, int8 activation blocks, VNNI), W4G64 dequantize + F.linear (the
        many-row path), float32 and bfloat16 F.linear on the same weight, and GGUF Q4_0 / Q4_1
        held (quant_gemm.c's kvq_linear), interleaved call by call. What W4_C_ROWS_MAX is
        chosen from.

    .venv/bin/python bench/int4.py --w4a16 DIR [--rounds 3]
        DIR: the default model quantized to compressed-tensors W4A16 by bench/make_w4a16.py.
        Variants: the float32 expansion of the shipped GGUF (the quality reference; W4A16
        was quantized from it), bfloat16, GGUF Q4_0 held (a re-quantization of the float32
        expansion, as bench/quantized.py makes it) and W4A16 held. Per variant: weight MiB,
        batch-1 TPOT (32 tokens, the prompt cached), concurrency-32 offline tok/s (32 chat
        prompts x 64 tokens, ignore_eos), teacher-forced top-1 agreement and mean |dlogprob|
        against float32 on 16 chat prompts x 64 float32-greedy tokens. The 1-minute load
        average is printed with each timing row (the machine is shared).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SHAPES = {"q / o": (576, 576), "k / v": (192, 576), "gate / up": (1536, 576), "down": (576, 1536)}
ROWS = (1, 4, 16, 32, 64, 128, 256)


def _best_ms(fns, rounds: int) -> list[float]:
    """Each function's fastest of `rounds` calls, interleaved call by call: on this shared
    machine (load 3-14 while measured) a median mostly measures the other sessions."""
    times: list[list[float]] = [[] for _ in fns]
    for fn in fns:
        fn()
    for _ in range(rounds):
        for fn, samples in zip(fns, times):
            start = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - start) * 1e3)
    return [min(t) for t in times]


def _paths(x, w4, dense, gguf_q, y, scratch) -> list:
    import torch.nn.functional as F

    from kvserve.kernels import int4, quant

    xb, bf16 = x.bfloat16(), dense.bfloat16()
    return [
        lambda: int4.gemm_c(x, w4, y),
        lambda: F.linear(x, int4.dequantize_rows_c(w4, scratch)),
        lambda: F.linear(x, dense),
        lambda: F.linear(xb, bf16),
        lambda: quant.gemm_c(x, gguf_q["Q4_0"], y),
        lambda: quant.gemm_c(x, gguf_q["Q4_1"], y),
    ]


def kernel_table(rounds: int) -> None:
    import gguf
    import torch

    from kvserve.kernels import quant
    from kvserve.services.worker.quant_formats.int4 import pack_w4

    torch.manual_seed(0)
    print(f"load average at start: {os.getloadavg()[0]:.2f}")
    print("| layer | N x K | rows | W4G64 int8 C ms | W4G64 dequant + F.linear ms | float32 "
          "F.linear ms | bf16 F.linear ms | Q4_0 C ms | Q4_1 C ms | load |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for label, (n, k) in SHAPES.items():
        w = torch.randn(n, k) * 0.05
        g = w.reshape(n, k // 64, 64)
        scales = (g.abs().amax(-1) / 7.5).half()
        q = (torch.round(g / scales.float()[..., None]) + 8).clamp(0, 15).reshape(n, k).long()
        w4 = pack_w4(q, scales, torch.full_like(q[:, : k // 64], 8), 64)
        dense = w4.dequantize()
        gguf_q = {
            t: quant.QuantizedTensor(
                t, (n, k), torch.from_numpy(
                    gguf.quants.quantize(dense.numpy(), gguf.GGMLQuantizationType[t]))
            )
            for t in ("Q4_0", "Q4_1")
        }  # fmt: skip
        scratch = torch.empty(n * k)
        for rows in ROWS:
            x = torch.randn(rows, k)
            y = torch.empty(rows, n)
            fns = _paths(x, w4, dense, gguf_q, y, scratch.view(n, k))
            cells = " | ".join(f"{t:.3f}" for t in _best_ms(fns, rounds))
            print(f"| {label} | {n}x{k} | {rows} | {cells} | {os.getloadavg()[0]:.1f} |")


def end_to_end(w4a16_dir: str, rounds: int, speed_only: list[str] | None = None) -> None:
    from quantized import QUESTIONS, _score, _throughput, _tpot, variant_files

    from kvserve import LLM, SamplingParams
    from kvserve.services.worker.quantization import weight_bytes
    from kvserve.shared.env import CACHE_DIR

    files = variant_files(os.path.join(CACHE_DIR.get(), "requantized"))

    def make(name: str, **extra) -> LLM:
        kw = dict(kv_cache_memory_bytes=256 << 20, **extra)
        if name == "float32":
            return LLM(dtype="float32", **kw)
        if name == "bfloat16":
            return LLM(dtype="bfloat16", **kw)
        if name == "Q4_0":
            return LLM(model=files["Q4_0"], quantization="gguf", dtype="float32", **kw)
        return LLM(model=w4a16_dir, dtype="float32", **kw)  # detected: compressed-tensors

    def model_of(llm):
        return llm.engine_core.executor.worker.runner.model

    variants = tuple(speed_only or ("float32", "bfloat16", "Q4_0", "W4A16"))
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
    greedy = SamplingParams(max_tokens=64, temperature=0.0)
    summary: dict[str, dict] = {}
    ref_lp = sequences = prompts = None
    for name in ("float32",) if speed_only else variants:
        llm = make(name, max_num_batched_tokens=64, enable_prefix_caching=False)
        if sequences is None:
            outs = llm.chat(conversations, greedy, use_tqdm=False)
            prompts = [list(o.prompt_token_ids) for o in outs]
            sequences = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)]
        assert prompts is not None
        scored = _score(llm, sequences, [len(p) for p in prompts])
        lps = np.concatenate([[lp for lp, _ in s] for s in scored])
        ranks = np.concatenate([[r for _, r in s] for s in scored])
        ref_lp = lps if ref_lp is None else ref_lp
        summary[name] = {
            "weight_mib": weight_bytes(model_of(llm)) / 2**20,
            "agree": float(np.mean(ranks == 1)),
            "dlogprob": float(np.mean(np.abs(lps - ref_lp))),
            "tpot": [],
            "tok_s": [],
            "load": [],
        }
        del llm
    for name in variants:
        summary.setdefault(name, dict(summary["float32"], tpot=[], tok_s=[], load=[]))
    if speed_only:  # no quality figures for these
        for name in variants:
            summary[name].update(agree=float("nan"), dlogprob=float("nan"), weight_mib=0.0)
        summary = {name: summary[name] for name in variants}
    engines = {name: make(name) for name in variants}
    batch = (prompts * 3)[:32]
    for _ in range(rounds):
        for name, llm in engines.items():
            summary[name]["tpot"].append(_tpot(llm, prompts[0], 32))
            summary[name]["tok_s"].append(_throughput(llm, batch, 64))
            summary[name]["load"].append(os.getloadavg()[0])
    print("| weights | weight MiB | batch-1 TPOT ms | concurrency-32 tok/s | top-1 agreement "
          "vs float32 | mean abs dlogprob | load (1 min) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for name, s in summary.items():
        loads = f"{min(s['load']):.1f}-{max(s['load']):.1f}"
        print(
            f"| {name} | {s['weight_mib']:.1f} | {statistics.median(s['tpot']):.2f} | "
            f"{statistics.median(s['tok_s']):.1f} | {s['agree']:.1%} | {s['dlogprob']:.4f} | "
            f"{loads} |"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernels", action="store_true")
    parser.add_argument("--w4a16", default=None, help="the W4A16 folder (bench/make_w4a16.py)")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument(
        "--speed-only", nargs="+", default=None, help="time only these variants (no quality)"
    )
    args = parser.parse_args()
    if args.kernels:
        kernel_table(args.rounds or 20)
    if args.w4a16:
        end_to_end(args.w4a16, args.rounds or 3, args.speed_only)
    if not (args.kernels or args.w4a16):
        parser.error("pass --kernels and/or --w4a16 DIR")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
