"""Two fused mixture-of-experts paths, by token count: what layers/fused_moe.py picked from.

Times a gathered path (each (token, expert) row gathers its expert's weights for a batched
mat-vec) and the grouped path that fused_moe.fused_experts runs (rows sorted by expert,
`torch._grouped_mm`), on a Mixtral-shaped block scaled to this machine (8 experts, top 2;
--hidden, --inter), plus a Python loop over experts as the baseline a fused path must beat.
Prints ms per call (best of several) and which fused path wins.

    .venv/bin/python bench/moe_paths.py [--dtype float32 bfloat16] [--hidden 1024] [--inter 1792]
"""

from __future__ import annotations

import argparse
import time

import torch

from kvserve import kernels
from kvserve.services.worker.layers.fused_moe import fused_experts, select_experts

TOKENS = (1, 2, 4, 8, 16, 32, 64, 256, 1024)


def _seconds(fn, *args, min_s: float = 0.2) -> float:
    fn(*args)
    samples, deadline = [], time.perf_counter() + min_s
    while len(samples) < 3 or time.perf_counter() < deadline:
        start = time.perf_counter()
        fn(*args)
        samples.append(time.perf_counter() - start)
    return min(samples)  # load only adds time


def fused_experts_gathered(x, w13, w2, weights, expert_ids):
    # Each (token, expert) row gathers its expert's matrices: one batched mat-vec each.
    num_tokens, top_k = expert_ids.shape
    flat_ids = expert_ids.reshape(-1)
    rows = x.repeat_interleave(top_k, dim=0).unsqueeze(-1)  # [T*k, H, 1]
    gate_up = torch.bmm(w13.index_select(0, flat_ids), rows).squeeze(-1)  # [T*k, 2I]
    act = kernels.silu_and_mul(gate_up).unsqueeze(-1)
    out = torch.bmm(w2.index_select(0, flat_ids), act).view(num_tokens, top_k, -1)
    return (out * weights.to(out.dtype).unsqueeze(-1)).sum(dim=1)


def _loop_over_experts(x, w13, w2, weights, expert_ids):
    out = torch.zeros_like(x)
    for e in range(w13.shape[0]):
        token_idx, slot = (expert_ids == e).nonzero(as_tuple=True)
        if token_idx.numel():
            h = kernels.silu_and_mul(x[token_idx] @ w13[e].T) @ w2[e].T
            out.index_add_(0, token_idx, h * weights[token_idx, slot, None].to(x.dtype))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--inter", type=int, default=1792)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    args = parser.parse_args()
    print(f"threads {torch.get_num_threads()}")
    for dtype_name in args.dtype:
        dtype = getattr(torch, dtype_name)
        torch.manual_seed(0)
        w13 = torch.randn(args.experts, 2 * args.inter, args.hidden, dtype=dtype) * 0.02
        w2 = torch.randn(args.experts, args.hidden, args.inter, dtype=dtype) * 0.02
        print(f"\n{dtype_name}: E={args.experts} top_k={args.top_k} H={args.hidden} I={args.inter}")
        print(f"{'tokens':>7} {'rows':>5} {'gathered':>10} {'grouped':>10} {'loop':>10}  winner")
        for num_tokens in TOKENS:
            x = torch.randn(num_tokens, args.hidden, dtype=dtype)
            logits = torch.randn(num_tokens, args.experts)
            inputs = (x, w13, w2, *select_experts(logits, args.top_k, True))
            grouped = _seconds(fused_experts, *inputs)
            # The gathered path copies top_k expert matrices per token: skip it where that
            # copy would not fit in memory comfortably.
            rows = num_tokens * args.top_k
            gathered = _seconds(fused_experts_gathered, *inputs) if rows <= 64 else float("nan")
            loop = _seconds(_loop_over_experts, *inputs)
            winner = "gathered" if gathered < grouped else "grouped"
            print(
                f"{num_tokens:>7} {rows:>5} {gathered * 1e3:>10.3f} {grouped * 1e3:>10.3f} "
                f"{loop * 1e3:>10.3f}  {winner}"
            )


if __name__ == "__main__":
    main()
