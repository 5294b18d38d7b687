"""DP routing simulator: vLLM's load rule vs prefix-aware routing over 8-64 simulated engines.

Replays a multi-tenant workload (Zipf-popular tenants with shared prefixes, unique suffixes,
Poisson arrivals) over a fleet of simulated kvserve engines, each with a block-granular LRU
prefix cache and a continuous-batching scheduler whose step durations come from a model fitted
to measured kvserve steps (bench/step_times.json, from bench/measure_step_times.py). Modules:

    workload.py     tenants, requests, block-hash chains
    block_cache.py  one engine's prefix cache (counts and keys, LRU)
    engine.py       one engine's scheduler and the step-time model
    routers.py      round_robin, load (vLLM's rule), prefix
    simulator.py    the event loop and per-run metrics
    sweep.py        capacity calibration, the sweep, the table
    __main__.py     the CLI

Run from the repository root (pure Python + numpy, one core):

    .venv/bin/python bench/dp_routing_sim --engines 8 16 32 64 \
        --routers load prefix round_robin --seed 0

(`python -m bench.dp_routing_sim ...` works too; `--save-result FILE` writes JSON.)

Default sweep, seed 0 (128 tenants, Zipf 1.0, prefixes 512-2048, suffixes 128-384, outputs
64-192 tokens; 4096 blocks of 16 per engine; 2048-token budget, 256 seqs; 250 requests per
engine, the first 20 % left out as warm-up; load 70 % of a prefix-blind engine's capacity;
prefix slack 8; step model bench/step_times.json, bfloat16 on the shared 2-core VM, so times
are CPU-engine seconds). 105 s wall on the busy VM (44 s CPU):

| engines | router | req/s | hit rate | ideal hit | TTFT mean s | TTFT P99 s | TPOT mean ms | busy skew | req skew | util | preempt |
|---|---|---|---|---|---|---|---|---|---|---|---|
| 8 | load | 0.5 | 57.3% | 82.0% | 2.34 | 6.83 | 588 | 1.01 | 1.03 | 99% | 0 |
| 8 | prefix | 0.5 | 80.1% | 82.0% | 1.49 | 5.42 | 589 | 1.03 | 1.20 | 97% | 0 |
| 8 | round_robin | 0.5 | 58.0% | 82.0% | 2.31 | 6.64 | 616 | 1.01 | 1.00 | 99% | 0 |
| 16 | load | 0.9 | 55.8% | 83.0% | 2.38 | 6.84 | 556 | 1.01 | 1.04 | 99% | 0 |
| 16 | prefix | 0.9 | 82.4% | 83.0% | 1.35 | 3.68 | 557 | 1.02 | 1.19 | 96% | 0 |
| 16 | round_robin | 0.9 | 55.5% | 83.0% | 2.38 | 6.72 | 595 | 1.01 | 1.00 | 99% | 0 |
| 32 | load | 1.8 | 56.5% | 83.7% | 2.27 | 6.58 | 518 | 1.01 | 1.07 | 99% | 0 |
| 32 | prefix | 1.8 | 83.3% | 83.7% | 1.25 | 2.28 | 523 | 1.03 | 1.20 | 97% | 0 |
| 32 | round_robin | 1.8 | 56.7% | 83.7% | 2.27 | 6.43 | 554 | 1.01 | 1.00 | 99% | 0 |
| 64 | load | 3.7 | 56.9% | 83.7% | 2.23 | 6.43 | 501 | 1.01 | 1.06 | 99% | 0 |
| 64 | prefix | 3.7 | 83.5% | 83.7% | 1.25 | 2.16 | 524 | 1.04 | 1.29 | 96% | 0 |
| 64 | round_robin | 3.7 | 56.3% | 83.7% | 2.26 | 6.37 | 542 | 1.01 | 1.00 | 99% | 0 |

Columns: hit rate = cached prompt tokens / prompt tokens; ideal hit = the same for one engine
with unbounded KV (each tenant's first request misses); busy skew = max / mean of per-engine
busy seconds (time inside steps); req skew = max / mean of requests routed per engine; util =
mean busy seconds / makespan (continuous batching keeps a loaded engine always stepping, so
this is near 100 % at any real load); preempt = preemptions in the fleet.

Reading: the prefix-blind routers (load, round robin) sit at ~56 % hit whatever the fleet size,
because each engine sees the whole tenant mix at the same per-engine rate and its 64k-token
cache holds only the popular tenants' prefixes. The prefix router reaches 97-100 % of the
ideal, and its edge in P99 TTFT grows with the fleet (5.4 vs 6.8 s at 8 engines, 2.2 vs 6.4 s
at 64): the fleet's total cache grows with it, so more rare tenants keep their prefix on their
home engine. A probe of the seed-0 runs (not part of the CLI) showed the slowest 1 % at 8
engines were mostly long prompts of rare tenants, 15 % cached (evicted between visits); at 64
engines they were the hottest tenants' requests queueing, 64 % cached (tenant 0 spread over 11
engines). The prefix router sends up to 1.3x the mean number of requests to one engine, yet
busy time stays within 4 % of the mean: those requests are cheap hits.
"""
