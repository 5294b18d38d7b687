"""The agent workload's stream parsing and its report: read / cacheable tokens per turn
from Anthropic and OpenAI stream events, and the hit rate over the turns that can hit."""

from __future__ import annotations

from kvserve.benchmarks.agent import AgentStats, _piece_and_usage, report


def test_stream_events_give_text_and_cache_usage():
    delta = {
        "type": "content_block_delta",
        "index": 0,
        "delta": {"type": "text_delta", "text": "hi"},
    }
    assert _piece_and_usage(delta) == ("hi", None)
    usage = {"cache_read_input_tokens": 90, "cache_creation_input_tokens": 10, "input_tokens": 5}
    assert _piece_and_usage({"type": "message_delta", "usage": usage}) == ("", (90, 100))
    chunk = {"choices": [{"delta": {"content": "x"}}]}
    assert _piece_and_usage(chunk) == ("x", None)
    last = {"choices": [], "usage": {"prompt_tokens_details": {"cached_tokens": 64}}}
    assert _piece_and_usage(last) == ("", (64, 0))
    assert _piece_and_usage({"type": "ping"}) == ("", None)


def test_report_rates_the_turns_after_the_first():
    stats = AgentStats(
        ttfts=[0.1, 0.2, 0.3, 0.4],
        read=[100, 50],
        cacheable=[100, 100],
        first_read=[0, 0],
        first_cacheable=[100, 100],
        churn_done=3,
        churn_output_tokens=60,
    )
    result = report(stats, seconds=2.0)
    assert result["agent_prefix_hit_rate"] == 0.75
    assert result["agent_prefix_hit_rate_all_turns"] == 150 / 400
    assert result["churn_output_tok_per_s"] == 30.0
    assert result["agent_turns"] == 4 and result["num_errors"] == 0
