"""Suffix decoding against ngram and no speculation at batch 1, in one process: the agent
loop (agent.jsonl) and the JSON-schema requests (json.jsonl under JSON_SCHEMA).

Every mode is one in-process engine (`LLM`, the uni executor), all built first; then rounds
run the modes interleaved (A B C A B C ...), each mode's turns one request at a time
(greedy, max_tokens = the reference reply's length, so every mode emits the same tokens;
the script checks that they do). Both wall time and this process's CPU time are reported:
on a shared machine the CPU time is the steadier figure (OMP_NUM_THREADS=1 makes the two
the same on an idle one).

    OMP_NUM_THREADS=1 .venv/bin/python bench/spec_decode/agent_loop.py --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from make_datasets import JSON_SCHEMA  # noqa: E402
from run import NGRAM, SUFFIX  # noqa: E402

from kvserve import LLM, SamplingParams  # noqa: E402
from kvserve.services.scheduler.core.suffix_proposer import TenantOutputs  # noqa: E402
from kvserve.shared.structured_outputs import StructuredOutputsParams  # noqa: E402

MODES = {
    "off": None,
    "ngram": NGRAM,
    "suffix": SUFFIX,
    # The adaptive rule as before suffix drafts were scored (alpha ** j for every method).
    "suffix-alpha": SUFFIX,
    "suffix-fixed": {**SUFFIX, "adaptive": False},
    "suffix-f4": {**SUFFIX, "adaptive": False, "suffix_decoding_max_spec_factor": 4.0},
}
JSON_MAX_TOKENS = 160


def load(name: str, num: int) -> list[tuple[str, str]]:
    with open(os.path.join(HERE, name)) as f:
        rows = [json.loads(line)["conversations"] for line in f][:num]
    return [(c[0]["value"], c[1]["value"]) for c in rows]


def run_turns(llm: LLM, turns: list[tuple[str, str]], workload: str) -> tuple[float, float, list]:
    """(wall s, CPU s, outputs) of the turns, one request at a time."""
    tokenizer = llm.get_tokenizer()
    outputs = []
    wall, cpu = time.perf_counter(), time.process_time()
    for prompt, reply in turns:
        if workload == "json":
            params = SamplingParams(
                temperature=0.0,
                max_tokens=JSON_MAX_TOKENS,
                structured_outputs=StructuredOutputsParams(json=JSON_SCHEMA),
            )
        else:
            params = SamplingParams(temperature=0.0, max_tokens=len(tokenizer.encode(reply)))
        (out,) = llm.chat([{"role": "user", "content": prompt}], params, use_tqdm=False)
        outputs.append(out.outputs[0].token_ids)
    return time.perf_counter() - wall, time.process_time() - cpu, outputs


def forget_outputs(llm: LLM) -> None:
    """Empty suffix decoding's store of finished outputs, so a round never drafts from the
    previous round's identical requests (within a round, a turn drafts from the earlier
    turns' replies, as in an agent loop)."""
    spec = llm.engine_core.scheduler.spec_decode
    proposer = getattr(spec, "proposer", None)
    if proposer is not None:
        proposer.outputs = TenantOutputs(proposer.outputs.max_cached_requests)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--modes", default="off,ngram,suffix")
    parser.add_argument("--workloads", default="agent,json")
    parser.add_argument("--turns", type=int, default=6)
    options = parser.parse_args()
    modes = options.modes.split(",")
    engines = {
        m: LLM(dtype="float32", kv_cache_memory=1 << 28, speculative_config=MODES[m]) for m in modes
    }
    if "suffix-alpha" in engines:
        engines["suffix-alpha"].engine_core.scheduler.spec_decode.policy.trims_proposals = False
    for workload in options.workloads.split(","):
        turns = load(f"{workload}.jsonl", options.turns)
        figures: dict[str, list[tuple[float, float, int]]] = {m: [] for m in modes}
        reference = None
        for round_index in range(options.rounds):
            shift = round_index % len(modes)
            for mode in modes[shift:] + modes[:shift]:
                forget_outputs(engines[mode])
                wall, cpu, outputs = run_turns(engines[mode], turns, workload)
                reference = reference or outputs
                assert outputs == reference, f"{mode} emitted other tokens than {modes[0]}"
                num_tokens = sum(len(o) for o in outputs)
                figures[mode].append((wall, cpu, num_tokens))
                print(
                    f"round {round_index} {workload} {mode}: {num_tokens} tokens, "
                    f"{num_tokens / wall:.1f} tok/s wall, {num_tokens / cpu:.1f} tok/s CPU",
                    flush=True,
                )
        print_table(workload, figures, modes)
    return 0


def print_table(workload: str, figures, modes) -> None:
    print(
        f"\n| {workload} | tok/s wall (median, range) | x off | tok/s CPU (median, range) | x off |"
    )
    print("|---|---|---|---|---|")
    base_wall = [n / w for w, _, n in figures[modes[0]]]
    base_cpu = [n / c for _, c, n in figures[modes[0]]]
    for mode in modes:
        wall = [n / w for w, _, n in figures[mode]]
        cpu = [n / c for _, c, n in figures[mode]]
        x_wall = statistics.median(a / b for a, b in zip(wall, base_wall))
        x_cpu = statistics.median(a / b for a, b in zip(cpu, base_cpu))
        print(
            f"| {mode} | {statistics.median(wall):.1f} ({min(wall):.1f}-{max(wall):.1f}) | "
            f"{x_wall:.2f} | {statistics.median(cpu):.1f} ({min(cpu):.1f}-{max(cpu):.1f}) | "
            f"{x_cpu:.2f} |"
        )


if __name__ == "__main__":
    sys.exit(main())
