"""DPRouter: vLLM's load score, local bumps between load tables, prefix preference."""

from __future__ import annotations

import pytest

from kvserve.services.api.engine_client.dp_router import PREFIX_LOAD_SLACK, WAITING_WEIGHT, DPRouter
from kvserve.shared.hashing import get_hash_fn, hash_new_full_blocks
from kvserve.shared.wire import EngineLoad

BLOCK_SIZE = 4


def make_router(routing: str = "load", num_engines: int = 2, num_blocks: int = 64) -> DPRouter:
    router = DPRouter(routing, BLOCK_SIZE, get_hash_fn("sha256"))
    for engine_index in range(num_engines):
        router.add_engine(engine_index, num_blocks)
    return router


def test_lowest_score_wins_and_waiting_weighs_four():
    router = make_router(num_engines=3)
    # Engine 0: 1 waiting (score 4); engine 1: 3 running (3); engine 2: 1 waiting 1 running.
    router.update_loads([EngineLoad(0, 1, 0), EngineLoad(1, 0, 3), EngineLoad(2, 1, 1)])
    assert [router.score(i) for i in range(3)] == [WAITING_WEIGHT, 3, WAITING_WEIGHT + 1]
    assert router.choose([1, 2, 3]) == 1


def test_bumps_spread_a_burst_until_the_next_table():
    router = make_router()
    chosen = [router.choose([7] * 5) for _ in range(6)]
    assert chosen == [0, 1, 0, 1, 0, 1]
    assert router.score(0) == router.score(1) == 3 * WAITING_WEIGHT
    # The coordinator's table replaces the local estimates.
    router.update_loads([EngineLoad(0, 0, 5), EngineLoad(1, 0, 0)])
    assert router.choose([7]) == 1


def test_ties_go_round_robin():
    router = make_router(num_engines=3)
    chosen = []
    for _ in range(4):
        chosen.append(router.choose([1]))
        router.update_loads([EngineLoad(i, 0, 0) for i in range(3)])  # all idle again
    assert chosen == [0, 1, 2, 0]


def test_candidates_and_removed_engines():
    router = make_router(num_engines=3)
    router.update_loads([EngineLoad(0, 0, 0), EngineLoad(1, 0, 9), EngineLoad(2, 0, 9)])
    assert router.choose([1], candidate_ids=[1, 2]) == 1
    router.remove_engine(0)
    assert router.engine_indices == [1, 2]
    router.update_loads([EngineLoad(0, 0, 0)])  # a dropped engine stays out
    # Engine 1 got the request above (score 9 + 4 waiting), so engine 2 (score 9) wins.
    assert router.choose([1]) == 2
    router.remove_engine(1)
    router.remove_engine(2)
    with pytest.raises(ValueError, match="every engine is dead"):
        router.choose([1])


def test_prefix_routing_follows_the_engine_that_holds_the_chain():
    router = make_router("prefix")
    prefix_a, prefix_b = list(range(100, 116)), list(range(200, 216))  # 4 blocks each
    first_a = router.choose(prefix_a + [1, 2])
    first_b = router.choose(prefix_b + [1, 2])
    assert {first_a, first_b} == {0, 1}  # by load: one each
    for suffix in range(5):
        assert router.choose(prefix_a + [suffix] * 6) == first_a
        assert router.choose(prefix_b + [suffix] * 6) == first_b
    # Load routing would have alternated regardless of the prompt.
    load_router = make_router("load")
    assert [load_router.choose(prefix_a) for _ in range(4)] == [0, 1, 0, 1]


def test_prefix_preference_yields_beyond_the_load_slack():
    router = make_router("prefix")
    prompt = list(range(100, 124))
    holder = router.choose(prompt)
    other = 1 - holder
    slack_in_waiting = PREFIX_LOAD_SLACK // WAITING_WEIGHT
    router.update_loads([EngineLoad(holder, slack_in_waiting, 0), EngineLoad(other, 0, 0)])
    assert router.choose(prompt) == holder  # at the slack: still preferred
    router.update_loads([EngineLoad(holder, slack_in_waiting + 1, 0), EngineLoad(other, 0, 0)])
    assert router.choose(prompt) == other  # beyond it: the load wins
    # Now both hold the chain: the less loaded one gets it.
    router.update_loads([EngineLoad(holder, 0, 0), EngineLoad(other, 0, 2)])
    assert router.choose(prompt) == holder


def test_the_longest_leading_match_wins():
    router = make_router("prefix")
    shared, tail_a, tail_b = [5] * 8, [6] * 8, [7] * 8
    router.choose(shared + tail_a, candidate_ids=[0])  # engine 0 holds s s a a
    router.choose(shared + tail_b, candidate_ids=[1])  # engine 1 holds s s b b
    router.update_loads([EngineLoad(0, 0, 0), EngineLoad(1, 0, 0)])
    assert router.choose(shared + tail_b + [9] * 4) == 1  # 4 blocks on 1, 2 on 0
    router.update_loads([EngineLoad(0, 0, 3), EngineLoad(1, 0, 0)])
    assert router.choose(shared + tail_a + [9] * 4) == 0  # 4 blocks on 0, within the slack
    # Block a's tokens at the start hash differently from a inside a chain: no match, so
    # the least loaded engine.
    assert router.choose(tail_a + tail_a) == 1


def test_hashes_match_the_engines_chain_and_salt():
    router = make_router("prefix")
    prompt = list(range(10))  # two full blocks and a partial one
    expected = hash_new_full_blocks(get_hash_fn("sha256"), BLOCK_SIZE, prompt, [])
    assert router.block_hashes(prompt) == expected and len(expected) == 2
    assert router.block_hashes(prompt, b"salt\x00x") != expected
    assert make_router("load").block_hashes(prompt) == []


def test_remembered_hashes_are_bounded_by_the_engine_blocks():
    router = make_router("prefix", num_engines=1, num_blocks=3)
    router.choose(list(range(100, 120)))  # 5 blocks, only 3 remembered (the last ones)
    assert len(router._engines[0].cached_hashes) == 3


def test_unknown_routing_is_rejected():
    with pytest.raises(ValueError, match="use 'load' or 'prefix'"):
        DPRouter("random", BLOCK_SIZE, None)


def test_a_prefix_in_the_shared_store_goes_to_the_least_loaded_engine():
    """Engines that share a KV store (kv_both) can each load what another saved: the store's
    chain counts for all of them, so the load decides; without the store the holder wins."""
    prompt = list(range(100, 124))
    for kv_role, expected in (("kv_both", "least loaded"), (None, "holder")):
        router = DPRouter("prefix", BLOCK_SIZE, get_hash_fn("sha256"))
        for engine_index in range(2):
            router.add_engine(engine_index, 64, kv_role)
        holder = router.choose(prompt)
        other = 1 - holder
        router.update_loads([EngineLoad(holder, 0, 3), EngineLoad(other, 0, 0)])
        assert router.num_matched_blocks(other, router.block_hashes(prompt)) == (
            6 if kv_role else 0
        )
        assert router.choose(prompt) == (other if expected == "least loaded" else holder)


def test_only_savers_fill_the_store_and_only_loaders_read_it():
    """P/D: a prefill engine (kv_producer) saves, a decode engine (kv_consumer) loads; a
    consumer's own sends never put blocks in the store."""
    prompt = list(range(300, 316))
    router = DPRouter("prefix", BLOCK_SIZE, get_hash_fn("sha256"))
    router.add_engine(0, 64, "kv_producer")
    router.add_engine(1, 64, "kv_consumer")
    router.add_engine(2, 64, "kv_consumer")
    hashes = router.block_hashes(prompt)
    router.choose(prompt, candidate_ids=[1])  # a consumer computed it: nothing saved
    assert router.num_matched_blocks(2, hashes) == 0
    router.choose(prompt, candidate_ids=[0])  # the producer saved it
    assert router.num_matched_blocks(2, hashes) == len(hashes) == 4
    assert router.num_matched_blocks(0, hashes) == 4  # its own cache, not the store


def test_a_ttft_target_prefers_an_engine_predicted_to_meet_it():
    router = make_router(num_engines=3)
    # Engine 0 scores lowest but is predicted 900 ms behind (a long prefill); engines 1 and
    # 2 are predicted to meet a 200 ms target, and of those 1 scores lower.
    router.update_loads(
        [
            EngineLoad(0, 0, 1, predicted_queue_delay_ms=900.0),
            EngineLoad(1, 0, 3, predicted_queue_delay_ms=50.0),
            EngineLoad(2, 1, 2, predicted_queue_delay_ms=150.0),
        ]
    )
    assert router.choose([1], ttft_ms=200.0) == 1
    # Without a target, or when no engine can meet it, the score rule decides.
    assert router.choose([1]) == 0
    assert router.choose([1], ttft_ms=10.0) == 0
    # The delay bound holds within the candidates the caller allows.
    assert router.choose([1], candidate_ids=[0, 2], ttft_ms=200.0) == 2


def test_a_ttft_target_composes_with_the_prefix_preference():
    router = make_router("prefix")
    prompt = list(range(4 * BLOCK_SIZE))
    holder = router.choose(prompt)  # holds the prompt's blocks now
    other = 1 - holder
    router.update_loads(
        [
            EngineLoad(holder, 0, 0, predicted_queue_delay_ms=500.0),
            EngineLoad(other, 0, 0, predicted_queue_delay_ms=0.0),
        ]
    )
    assert router.choose(prompt) == holder
    assert router.choose(prompt, ttft_ms=100.0) == other
