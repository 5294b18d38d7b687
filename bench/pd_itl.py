"""The claim behind P/D, measured: long prompts arriving among streaming decodes.

Two setups of the shipped server on the default model (float32), the same two clients:

- colocated: `kvserve serve` (one engine core on both cores);
- P/D: `kvserve serve --prefill-size 1 --decode-size 1`, the prefill engine pinned to core
  0 and the decode engine to core 1 (every thread of each, after start-up; one OpenMP
  thread each, as the launcher splits the cores).

Clients (`kvserve bench serve`, run at the same time): DECODES streams of 64-token prompts
and 256 generated tokens at fixed concurrency, and LONG prompts of 2,048 tokens (8 out) at a
Poisson rate. Reported: the decodes' P99 ITL, the long prompts' P99 TTFT, per setup, over
interleaved rounds (A B A B), medians.

    .venv/bin/python bench/pd_itl.py --rounds 2
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KVSERVE = [sys.executable, "-m", "kvserve.cli"]


def _health(port: int) -> dict | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            return json.load(r)
    except OSError:
        return None


def start(setup: str, port: int, log_path: str) -> subprocess.Popen:
    args = [*KVSERVE, "serve", "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32"]
    args += ["--uvicorn-log-level", "warning", "--max-model-len", "4096"]
    if setup == "pd":
        args += ["--prefill-size", "1", "--decode-size", "1", "--kv-store-size", "2G"]
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    process = subprocess.Popen(
        args, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, cwd=ROOT, env=env
    )
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        body = _health(port)
        if body is not None and body.get("status") == "healthy":
            if setup == "pd":
                for engine in body["engines"]:
                    core = 0 if engine["kv_role"] == "kv_producer" else 1
                    _pin(engine["pid"], core)
            return process
        if process.poll() is not None:
            raise SystemExit(f"{setup}: the server exited; see {log_path}")
        time.sleep(1)
    raise SystemExit(f"{setup}: not healthy after 600 s")


def _pin(pid: int, core: int) -> None:
    """Every thread of `pid` (OpenMP's included) to one core."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(tid), {core})


def run_clients(port: int, out_dir: str, label: str, args) -> tuple[dict, dict]:
    common = [*KVSERVE, "bench", "serve", "--base-url", f"http://127.0.0.1:{port}"]
    common += ["--dataset-name", "random", "--ignore-eos", "--disable-tqdm", "--save-result"]
    common += ["--result-dir", out_dir, "--percentile-metrics", "ttft,itl,tpot"]
    common += ["--metric-percentiles", "50,99"]
    decodes = [*common, "--random-input-len", "64", "--random-output-len", "256"]
    decodes += ["--num-prompts", str(args.num_decodes), "--max-concurrency", str(args.concurrency)]
    decodes += ["--seed", "1", "--result-filename", f"{label}-decodes.json"]
    longs = [*common, "--random-input-len", "2048", "--random-output-len", "8"]
    longs += ["--num-prompts", str(args.num_long), "--request-rate", str(args.long_rate)]
    longs += ["--seed", "2", "--result-filename", f"{label}-long.json"]
    quiet = {"stdout": subprocess.DEVNULL, "cwd": ROOT}
    first = subprocess.Popen(decodes, **quiet)
    time.sleep(2)  # the decodes are streaming when the first long prompt arrives
    second = subprocess.Popen(longs, **quiet)
    if first.wait() or second.wait():
        raise SystemExit(f"{label}: a client failed")
    with open(os.path.join(out_dir, f"{label}-decodes.json")) as f:
        decode_result = json.load(f)
    with open(os.path.join(out_dir, f"{label}-long.json")) as f:
        long_result = json.load(f)
    return decode_result, long_result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--num-decodes", type=int, default=8)
    parser.add_argument("--num-long", type=int, default=4)
    parser.add_argument("--long-rate", type=float, default=0.1)
    parser.add_argument("--port", type=int, default=8041)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    out_dir = args.out or tempfile.mkdtemp(prefix="kvserve-pd-itl-")
    rows: dict[str, list[tuple[float, float, float]]] = {"colocated": [], "pd": []}
    for round_index in range(args.rounds):
        order = ["colocated", "pd"] if round_index % 2 == 0 else ["pd", "colocated"]
        for setup in order:
            label = f"{setup}-r{round_index}"
            server = start(setup, args.port, os.path.join(out_dir, f"{label}.log"))
            try:
                decodes, longs = run_clients(args.port, out_dir, label, args)
            finally:
                server.terminate()
                server.wait(timeout=120)
            row = (decodes["p99_itl_ms"], longs["p99_ttft_ms"], decodes["mean_itl_ms"])
            rows[setup].append(row)
            print(
                f"round {round_index} {setup}: decode ITL p99 {row[0]:.1f} ms (mean "
                f"{row[2]:.1f}), long-prompt TTFT p99 {row[1]:.0f} ms",
                flush=True,
            )
    print()
    print("| setup | decode ITL P99 ms | decode ITL mean ms | long-prompt TTFT P99 ms |")
    print("|---|---|---|---|")
    for setup, values in rows.items():
        itl = statistics.median(v[0] for v in values)
        mean = statistics.median(v[2] for v in values)
        ttft = statistics.median(v[1] for v in values)
        print(f"| {setup} | {itl:.1f} | {mean:.1f} | {ttft:.0f} |")
    colocated = statistics.median(v[0] for v in rows["colocated"])
    pd = statistics.median(v[0] for v in rows["pd"])
    print(f"P/D decode ITL P99 / colocated: {pd / colocated:.2f} (median of {args.rounds} rounds)")
    print(f"results in {out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
