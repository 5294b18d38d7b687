"""vLLM flags kvserve knows but cannot honour, each with its reason (the error says it).

`kvserve serve` and `kvserve engine` parse these (shared/cli_args.add_refused_flags) so that
a vLLM flag is refused with a reason, never silently ignored. A reason says what kvserve
does instead; keep it true to the code when the feature behind it changes.
"""

from __future__ import annotations

from kvserve.shared.cli_args import RefusedFlag

_NO_HUB = "kvserve loads local folders, GGUF files and the local HF cache only (no downloads)"
_LATER = "not built yet"
# Measured and declined: docs/kernels.md, "No `torch.compile`".
_NO_COMPILE = (
    "torch.compile is not used (measured slower, with a 47 s start-up); CUDA graphs are "
    "set with --cuda-graph-sizes and --enforce-eager"
)
UNSUPPORTED_VLLM_FLAGS: dict[str, RefusedFlag] = {
    "--cpu-offload-gb": RefusedFlag("weights are never offloaded to CPU memory"),
    "--guided-decoding-backend": RefusedFlag(
        "vLLM replaced it with --structured-outputs-config; kvserve's backend is xgrammar",
        accepted=("auto", "xgrammar"),
    ),
    "--enable-expert-parallel": RefusedFlag(
        "MoE experts are split by tensor parallelism (each rank holds a slice of every "
        "expert), never spread whole across ranks"
    ),
    "--api-server-count": RefusedFlag(
        "one api process per server (scale engines with --data-parallel-size)", accepted=("1",)
    ),
    "--revision": RefusedFlag(_NO_HUB),
    "--code-revision": RefusedFlag(_NO_HUB),
    "--tokenizer-revision": RefusedFlag(_NO_HUB),
    "--download-dir": RefusedFlag(_NO_HUB),
    "--hf-token": RefusedFlag(_NO_HUB),
    "--load-format": RefusedFlag(
        "weights load from safetensors or GGUF as found", accepted=("auto", "safetensors", "gguf")
    ),
    "--tokenizer-mode": RefusedFlag(
        "the fast tokenizer (tokenizer.json) when present, else transformers' own",
        accepted=("auto",),
    ),
    "--compilation-config": RefusedFlag(_NO_COMPILE),
    "-O": RefusedFlag(_NO_COMPILE, accepted=("0",)),
    "--swap-space": RefusedFlag(
        "preempted requests are recomputed, never swapped to CPU (evicted prefix blocks can "
        "go to a CPU tier: --kv-offloading-size)"
    ),
    "--async-scheduling": RefusedFlag(f"asynchronous scheduling: {_LATER}"),
    "--device": RefusedFlag("the device is what torch finds (CUDA, else CPU)", accepted=("auto",)),
    "--worker-cls": RefusedFlag("the worker class is fixed"),
    "--worker-extension-cls": RefusedFlag("the worker class is fixed"),
}
