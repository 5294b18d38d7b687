"""Sleep mode (--enable-sleep-mode): what a sleep frees and what a wake_up costs.

The offline LLM on the default model (or --model), CPU or CUDA as torch finds: for level 1
and level 2, the seconds of sleep() and of wake_up(), the process's RSS before, asleep and
after waking (on CUDA also torch's allocated device memory), and whether the greedy tokens
after waking equal those before.

    .venv/bin/python bench/sleep_mode.py [--model DIR] [--kv-cache-memory BYTES]
"""

from __future__ import annotations

import argparse
import time

import psutil


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--kv-cache-memory", type=int, default=512 << 20)
    args = parser.parse_args()

    import torch

    from kvserve import LLM, SamplingParams

    llm = LLM(args.model, kv_cache_memory=args.kv_cache_memory, enable_sleep_mode=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    process = psutil.Process()

    def tokens() -> list[list[int]]:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]

    def memory() -> str:
        rss = f"RSS {process.memory_info().rss / 2**20:.0f} MiB"
        if torch.cuda.is_available():
            rss += f", device {torch.cuda.memory_allocated() / 2**20:.0f} MiB"
        return rss

    before = tokens()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"device {device}, KV cache budget {args.kv_cache_memory / 2**20:.0f} MiB")
    for level in (1, 2):
        awake = memory()
        start = time.perf_counter()
        llm.sleep(level)
        sleep_s = time.perf_counter() - start
        asleep = memory()
        start = time.perf_counter()
        llm.wake_up()
        wake_s = time.perf_counter() - start
        same = tokens() == before
        print(
            f"level {level}: sleep {sleep_s:.2f} s, wake_up {wake_s:.2f} s; awake {awake}, "
            f"asleep {asleep}, woken {memory()}; same greedy tokens: {same}"
        )
    llm.engine_core.shutdown()


if __name__ == "__main__":
    main()
