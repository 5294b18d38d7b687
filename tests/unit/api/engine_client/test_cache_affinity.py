"""prompt_cache_key affinity on the real DPRouter: a key sticks to its engine while its load
is within the slack of the least loaded one, and spills (and moves) past it."""

from __future__ import annotations

from kvserve.services.api.engine_client.dp_router import PREFIX_LOAD_SLACK, DPRouter
from kvserve.shared.hashing import get_hash_fn
from kvserve.shared.wire import EngineLoad


def _router(num_engines: int = 2) -> DPRouter:
    router = DPRouter("load", 4, get_hash_fn("sha256"))
    for engine_index in range(num_engines):
        router.add_engine(engine_index, 64)
    return router


def test_the_same_key_lands_on_the_same_engine():
    router = _router(3)
    first = router.choose([1, 2, 3], cache_key="agent-a")
    # Without the key the burst would go round-robin; with it, every request follows.
    assert [router.choose([4, 5], cache_key="agent-a") for _ in range(2)] == [first] * 2
    others = {router.choose([9], cache_key=f"agent-{n}") for n in "bcdef"}
    assert len(others) > 1  # other keys still spread by load


def test_a_key_spills_by_load_and_follows_its_new_engine():
    router = _router()
    home = router.choose([1], cache_key="k")
    away = 1 - home
    loads = {home: EngineLoad(home, 0, PREFIX_LOAD_SLACK), away: EngineLoad(away, 0, 0)}
    router.update_loads(loads.values())
    assert router.choose([1], cache_key="k") == home  # within the slack
    loads[home] = EngineLoad(home, 3, PREFIX_LOAD_SLACK)  # 12 + 8 past the least loaded
    router.update_loads(loads.values())
    assert router.choose([1], cache_key="k") == away
    router.update_loads([EngineLoad(home, 0, 0), EngineLoad(away, 0, 2)])
    assert router.choose([1], cache_key="k") == away  # the key moved with the spill


def test_a_dead_engine_loses_its_keys():
    router = _router()
    home = router.choose([1], cache_key="k")
    router.remove_engine(home)
    assert router.choose([1], cache_key="k") == 1 - home
