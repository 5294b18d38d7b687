"""DP routing simulator: vLLM's load rule vs prefix-aware routing over 8-64 simulated engines.

Replays a multi-tenant workload (Zipf-popular tenants with shared prefixes, unique suffixes,
Poisson arrivals, real token ids) over a fleet of simulated kvserve engines. The routing and
the prefix caches are kvserve's shipped code, not copies of it:

    load, prefix    kvserve.services.api.engine_client.dp_router.DPRouter, fed load tables every
                    `refresh_s` and each prompt's token ids (it hashes them itself)
    KV cache        kvserve.services.scheduler.core.kv_cache_manager.KVCacheManager over
                    kvserve.services.scheduler.core.block_pool.BlockPool, one per engine, with
                    block hashes from the engine's block hasher (kvserve.shared.hashing)

What is simulated: the model (step durations from a model fitted to measured kvserve steps,
bench/step_times.json from bench/measure_step_times.py; pre-drawn output tokens), the
scheduler's loop (engine.py, after services/scheduler/core/scheduler.py), the coordinator's
load-table period, and the round-robin baseline. Modules:

    workload.py     tenants, requests and their token ids
    engine.py       one engine: the scheduling loop over KVCacheManager, the step-time model
    routers.py      the shipped DPRouter for load/prefix, the round_robin baseline
    simulator.py    the event loop and per-run metrics
    sweep.py        capacity calibration, the sweep, the table
    __main__.py     the CLI

Run from the repository root (pure Python + numpy, one core; ~2 min for the default sweep):

    .venv/bin/python bench/dp_routing_sim --engines 8 16 32 64 \\
        --routers load prefix round_robin --seed 0

(`python -m bench.dp_routing_sim ...` works too; `--save-result FILE` writes JSON;
`--prefix-slack N` overrides the shipped PREFIX_LOAD_SLACK.) The figures of the default sweep
and how to read them are in bench/RESULTS.md, "DP routing simulation".
"""
