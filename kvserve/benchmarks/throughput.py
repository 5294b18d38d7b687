"""`kvserve bench throughput`: offline throughput of the engine on a synthetic workload.

Mirrors `vllm bench throughput --dataset-name random`: random token prompts of a fixed input
length, a fixed number of output tokens (ignore_eos), all submitted at once.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np


def add_parser(kinds) -> None:
    from kvserve.shared.cli_args import add_struct_args
    from kvserve.shared.config import EngineConfig

    p = kinds.add_parser("throughput", help="offline throughput (many prompts at once)")
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--random-input-len", "--input-len", dest="input_len", type=int, default=256)
    p.add_argument("--random-output-len", "--output-len", dest="output_len", type=int, default=128)
    p.add_argument("--bench-seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--save-result", default=None, help="write the figures to this JSON file")
    add_struct_args(p, EngineConfig, positional=("model",))
    p.set_defaults(func=run)


def random_prompts(
    num_prompts: int, input_len: int, vocab_size: int, special_ids: set[int], seed: int
) -> list[list[int]]:
    """Token-id prompts drawn uniformly from the non-special vocabulary."""
    rng = np.random.default_rng(seed)
    allowed = np.array([i for i in range(vocab_size) if i not in special_ids])
    return rng.choice(allowed, size=(num_prompts, input_len)).tolist()


def run(args: argparse.Namespace) -> int:
    from kvserve.launch.allocator import reexec_with_allocator

    reexec_with_allocator()  # the engine runs in this process: start it under tcmalloc
    from kvserve import LLM, SamplingParams
    from kvserve.shared.cli_args import struct_from_args
    from kvserve.shared.config import EngineConfig

    llm = LLM.from_config(struct_from_args(EngineConfig, args))
    tokenizer = llm.get_tokenizer()
    prompts = random_prompts(
        args.num_prompts,
        args.input_len,
        len(tokenizer),
        set(tokenizer.all_special_ids),
        args.bench_seed,
    )
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=1.0, top_p=1.0)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    num_in = sum(len(o.prompt_token_ids) for o in outputs)
    result = {
        "elapsed_time": elapsed,
        "num_requests": len(outputs),
        "total_num_tokens": num_in + num_out,
        "requests_per_second": len(outputs) / elapsed,
        "tokens_per_second": (num_in + num_out) / elapsed,
        "output_tokens_per_second": num_out / elapsed,
        "dtype": llm.config.model.dtype,
    }
    print(
        f"Throughput: {result['requests_per_second']:.2f} requests/s, "
        f"{result['tokens_per_second']:.2f} total tokens/s, "
        f"{result['output_tokens_per_second']:.2f} output tokens/s"
    )
    if args.save_result:
        with open(args.save_result, "w") as f:
            json.dump(result, f, indent=2)
    return 0
