"""`--kv-cache-dtype fp8` through the offline `LLM` on the default model: it serves, a repeated
prompt hits the prefix cache with the same tokens, and the offload tier (a KV store) takes
evicted fp8 blocks and brings them back bit for bit (the same greedy tokens again)."""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from tests.support.kv import assert_no_leaked_blocks

pytestmark = pytest.mark.slow

PROMPTS = [
    "Summarise this note for a colleague. " + "The meeting moved to Thursday at ten. " * 12,
    "Translate into French, line by line. " + "Good morning, how are you today? " * 10,
]
PARAMS = SamplingParams(temperature=0.0, max_tokens=12)


def _generate(llm: LLM, prompts) -> list[tuple[list[int], int]]:
    outputs = llm.generate(prompts, PARAMS, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), o.num_cached_tokens) for o in outputs]


def test_fp8_kv_serves_prefix_caches_and_offloads():
    # 9 usable blocks of 16 tokens: each prompt (~100 tokens, 7 blocks) evicts the other's.
    llm = LLM(
        dtype="bfloat16", kv_cache_dtype="fp8", kv_offloading_size=0.25, num_gpu_blocks_override=10
    )
    [(reference, cold_hits)] = _generate(llm, PROMPTS[:1])
    [(again, warm_hits)] = _generate(llm, PROMPTS[:1])
    assert cold_hits == 0 and warm_hits >= 96 and again == reference
    _generate(llm, PROMPTS[1:])  # evicts the first prompt's fp8 blocks into the store
    assert llm.stats_totals.kv_bytes_saved > 0
    [(reloaded, _)] = _generate(llm, PROMPTS[:1])
    assert reloaded == reference
    assert llm.stats_totals.external_prefix_cache_hits > 0
    assert_no_leaked_blocks(llm.engine_core.scheduler)
    llm.engine_core.shutdown()
