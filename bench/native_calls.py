"""Native calls per decoder layer in one decode step: the module path against the native stack.

Runs the default model in-process through the shipped `kvserve.LLM` (uni executor), decodes
one request a few tokens, and records one decode step's forward (`model.forward`) twice: with
the torch profiler (ATen ops dispatched) and with `sys.setprofile` (calls from Python into
C: ATen ops through their Python bindings, ctypes kernels, everything). Each count is divided
by the number of layers. KVSERVE_NATIVE_DECODE_ROWS picks the path in each child process.

    .venv/bin/python bench/native_calls.py                 # float32, both paths
    .venv/bin/python bench/native_calls.py --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys


def child(dtype: str) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from kvserve.llm import LLM
    from kvserve.shared import env
    from kvserve.shared.sampling_params import SamplingParams

    llm = LLM(dtype=dtype, max_model_len=512, kv_cache_memory=64 << 20)
    model = llm.engine_core.executor.worker.runner.model
    num_layers = model.config.num_hidden_layers
    recorded: dict[str, float] = {}
    real_forward = model.forward

    def forward(input_ids, positions, attn_metadata, *rest):
        if attn_metadata.max_query_len != 1 or recorded:
            return real_forward(input_ids, positions, attn_metadata, *rest)
        calls = 0

        def tracer(frame, event, arg):
            nonlocal calls
            if event == "c_call":
                calls += 1

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            sys.setprofile(tracer)
            try:
                out = real_forward(input_ids, positions, attn_metadata, *rest)
            finally:
                sys.setprofile(None)
        aten = sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))
        recorded.update(c_calls=calls, aten_ops=aten)
        return out

    model.forward = forward
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    with torch.inference_mode():
        llm.generate([{"prompt_token_ids": list(range(100, 120))}], params, use_tqdm=False)
    print(
        json.dumps(
            {
                "dtype": dtype,
                "native_rows": env.NATIVE_DECODE_ROWS.get(),
                "layers": num_layers,
                "c_calls_per_layer": recorded["c_calls"] / num_layers,
                "aten_ops_per_layer": recorded["aten_ops"] / num_layers,
            }
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.dtype)
        return
    for rows in (0, 8):
        env = dict(os.environ, KVSERVE_NATIVE_DECODE_ROWS=str(rows))
        command = [sys.executable, __file__, "--child", "--dtype", args.dtype]
        out = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
        print(out.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
