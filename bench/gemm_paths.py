"""The CPU GEMM paths of kernels/gemm.py on the default model's layer shapes, interleaved.

For each linear-layer shape of SmolLM2-135M (and its LM head) and each row count, times
every path that runs the dtype here (torch's F.linear, oneDNN's packed path, the native
GEMV up to 64 rows, the widened path for bfloat16) A B C A B C in one process, and prints
GFLOP/s per path next to what `kernels.gemm.measure_shape` (the start-up tuner) picks.

    .venv/bin/python bench/gemm_paths.py [--dtype float32 bfloat16] [--rounds 5]
        [--rows 1 32 256 2048]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from kvserve.kernels import gemm

# SmolLM2-135M: hidden 576, 9 query heads and 3 KV heads of 64, MLP 1536, vocab 49152.
SHAPES = {
    "qkv": (960, 576),
    "o_proj": (576, 576),
    "gate_up": (3072, 576),
    "down": (576, 1536),
    "lm_head": (49152, 576),
}
ROWS = (1, 32, 256, 2048)


def _seconds(fn, min_s: float = 0.05) -> float:
    fn()
    samples, deadline = [], time.perf_counter() + min_s
    while len(samples) < 3 or time.perf_counter() < deadline:
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return min(samples)  # load only adds time


def _calls(dtype: torch.dtype, weight: torch.Tensor, rows: int) -> dict:
    """The paths timed for this dtype and row count: path name -> call of x."""
    calls = {"torch": lambda x: F.linear(x, weight)}
    if gemm.onednn_available(dtype):
        packed = gemm.pack_onednn(weight)
        calls["onednn"] = lambda x: gemm.onednn_linear(x, packed, None)
    if gemm.native_available(dtype) and rows <= 64:
        calls["native"] = lambda x: gemm.native_linear(x, weight, None)
    if gemm.widened_available(dtype):
        calls["widened"] = lambda x: gemm.widened_linear(x, weight, None)
    return calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--rows", nargs="+", type=int, default=list(ROWS))
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| dtype | layer | N x K | rows | GFLOP/s per path | fastest | tuner |")
    print("|---|---|---|---|---|---|---|")
    for dtype_name in args.dtype:
        dtype = getattr(torch, dtype_name)
        for layer, (n, k) in SHAPES.items():
            weight = torch.randn(n, k, dtype=dtype) / k**0.5
            tuned = gemm.measure_shape(dtype, n, k, max_rows=max(args.rows))
            for rows in args.rows:
                if layer == "lm_head" and rows > 256:
                    continue  # logits only for the sampled rows (<= max_num_seqs)
                x = torch.randn(rows, k, dtype=dtype)
                calls = _calls(dtype, weight, rows)
                times: dict[str, list[float]] = {path: [] for path in calls}
                for _ in range(args.rounds):
                    for path, call in calls.items():
                        times[path].append(_seconds(lambda c=call, x=x: c(x)))
                rates = {path: 2 * rows * n * k / min(t) / 1e9 for path, t in times.items()}
                cells = ", ".join(f"{path} {rate:.0f}" for path, rate in rates.items())
                fastest = max(rates, key=lambda path: rates[path])
                print(
                    f"| {dtype_name} | {layer} | {n}x{k} | {rows} | {cells} | {fastest} | "
                    f"{tuned.path_for(rows)} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
