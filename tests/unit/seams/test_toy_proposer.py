"""A speculative method added in this file only, through the registry: a proposer that always
guesses the same token runs in a real EngineCore (Scheduler + ModelRunner on the tiny
model); its drafts are scheduled, verified and rolled back, and greedy output stays equal to
greedy output without speculation.
"""

from __future__ import annotations

import msgspec
import pytest

from kvserve.services.scheduler.engine.engine_core import EngineCore
from kvserve.services.worker.spec_decode.proposer import Proposer, proposal_requests
from kvserve.services.worker.spec_decode.registry import register_proposer
from kvserve.shared.config import CacheConfig, EngineConfig, ModelConfig, SpeculativeConfig
from kvserve.shared.messages import EngineCoreRequest
from kvserve.shared.sampling_params import SamplingParams
from tests.support.models import TINY_KV_CACHE_MEMORY

PROMPT = [(5 * i) % 250 + 1 for i in range(20)]


class AlwaysX(Proposer):
    """Proposes token `x` as every draft; records what it was asked."""

    x = 0
    calls: list[dict[str, int]] = []

    def __init__(self, ctx):
        self.ctx = ctx

    def propose(self, step, batch):
        asked = proposal_requests(step, batch, self.ctx.max_model_len)
        if asked is None:
            return {}
        AlwaysX.calls.append({s.req_id: int(n) for s, n in zip(asked.states, asked.num_drafts)})
        return {s.req_id: [AlwaysX.x] * int(n) for s, n in zip(asked.states, asked.num_drafts)}


def _engine(model_dir: str, spec: SpeculativeConfig | None) -> EngineCore:
    config = EngineConfig(
        model=ModelConfig(model=model_dir),
        cache=CacheConfig(kv_cache_memory_bytes=TINY_KV_CACHE_MEMORY),
    )
    # Set directly: the CLI's method choices list the built-in methods only.
    return EngineCore(msgspec.structs.replace(config, speculative_config=spec), model_dir)


def _greedy(engine: EngineCore) -> tuple[list[int], int, int]:
    """The tokens, and the drafts verified and accepted over the run."""
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    engine.add_request(EngineCoreRequest("r", PROMPT, params))
    tokens: list[int] = []
    num_drafts = num_accepted = 0
    while engine.has_work():
        outputs = engine.step()
        for out in outputs.outputs:
            assert out.error is None, out.error
            tokens += out.new_token_ids
        stats = outputs.scheduler_stats
        if stats is not None:
            num_drafts += stats.spec_num_draft_tokens
            num_accepted += stats.spec_num_accepted_tokens
    engine.shutdown()
    return tokens, num_drafts, num_accepted


@pytest.fixture(scope="module")
def reference(tiny_llama_dir) -> list[int]:
    return _greedy(_engine(tiny_llama_dir, None))[0]


@pytest.mark.parametrize("pick", ["never-right", "often-right"])
def test_a_registered_proposer_is_verified_by_the_real_engine(tiny_llama_dir, reference, pick):
    register_proposer("always_x", AlwaysX)
    # A token the reference never emits (every draft rejected), or its most common one.
    AlwaysX.x = (
        next(t for t in range(250) if t not in reference)
        if pick == "never-right"
        else max(set(reference), key=reference.count)
    )
    AlwaysX.calls = []
    spec = SpeculativeConfig(method="always_x", num_speculative_tokens=3, adaptive=False)
    tokens, num_drafts, num_accepted = _greedy(_engine(tiny_llama_dir, spec))
    assert tokens == reference
    assert AlwaysX.calls and all(n <= 3 for call in AlwaysX.calls for n in call.values())
    assert num_drafts > 0
    if pick == "never-right":
        assert num_accepted == 0
    elif reference.count(AlwaysX.x) > 1:
        assert num_accepted > 0


def test_an_unknown_method_names_the_registered_ones(tiny_llama_dir):
    spec = SpeculativeConfig(method="no_such_method", num_speculative_tokens=2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="registered: .*ngram"):
        _engine(tiny_llama_dir, spec)
