"""The scheduler and LoRA: at most max_loras adapters among running requests, the others
wait in order; adapters in the workers' request data and the stats; the block-hash rule."""

from __future__ import annotations

import json

import pytest

from kvserve.services.scheduler.core.features import SchedulerFeatures
from kvserve.services.scheduler.core.scheduler import Scheduler
from kvserve.shared.config import CacheConfig, LoRAConfig, SchedulerConfig
from kvserve.shared.lora import LoRARequest
from kvserve.shared.messages import EngineCoreRequest, FinishReason
from kvserve.shared.sampling_params import SamplingParams
from tests.support.kv import assert_no_leaked_blocks
from tests.support.scheduler import run_to_completion, step, submit


@pytest.fixture
def lora_dirs(tmp_path) -> dict[str, str]:
    """Adapter folders as far as the scheduler reads them (the config; the weights file
    only has to exist)."""
    dirs = {}
    for name, rank in (("a", 8), ("b", 8), ("c", 8), ("huge", 64)):
        folder = tmp_path / name
        folder.mkdir()
        config = {"peft_type": "LORA", "r": rank, "lora_alpha": 16, "target_modules": ["q_proj"]}
        (folder / "adapter_config.json").write_text(json.dumps(config))
        (folder / "adapter_model.safetensors").write_bytes(b"")
        dirs[name] = str(folder)
    return dirs


def make_scheduler(max_loras: int = 2, enable_lora: bool = True) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=4096, max_num_seqs=16),
        CacheConfig(block_size=16),
        num_blocks=200,
        max_model_len=512,
        features=SchedulerFeatures(
            lora_config=LoRAConfig(enable_lora=enable_lora, max_loras=max_loras)
        ),
    )


def lora_request(lora_dirs, name: str) -> LoRARequest:
    return LoRARequest(name, ord(name[0]), lora_dirs[name])


def request(req_id: str, lora: LoRARequest | None, prompt=None, max_tokens=3):
    return EngineCoreRequest(
        req_id,
        prompt or [5 + len(req_id)] * 20,
        SamplingParams(max_tokens=max_tokens),
        lora_request=lora,
    )


def test_at_most_max_loras_adapters_run_and_the_others_wait_in_order(lora_dirs):
    scheduler = make_scheduler(max_loras=2)
    a, b, c = (lora_request(lora_dirs, n) for n in "abc")
    arrivals = [("a1", a), ("b1", b), ("c1", c), ("base", None), ("c2", c), ("b2", b), ("a2", a)]
    for req_id, lora in arrivals:
        scheduler.add_request(request(req_id, lora))
    first, _ = step(scheduler)
    # c waits: a and b fill the two slots; the base model needs none.
    assert [new.req_id for new in first.scheduled_new_reqs] == ["a1", "b1", "base", "b2", "a2"]
    assert {new.req_id: new.lora_request for new in first.scheduled_new_reqs} == {
        "a1": a,
        "b1": b,
        "base": None,
        "b2": b,
        "a2": a,
    }
    assert [r.req_id for r in scheduler.waiting] == ["c1", "c2"]  # their order kept
    stats = scheduler.make_stats()
    assert stats.running_lora_adapters == {"a": 2, "b": 2}
    assert stats.waiting_lora_adapters == {"c": 2}

    seen_running = []
    while scheduler.has_requests():
        step(scheduler)
        seen_running.append({r.lora_int_id for r in scheduler.running if r.lora_int_id})
    assert max(len(ids) for ids in seen_running) <= 2
    assert_no_leaked_blocks(scheduler)


def test_one_slot_serialises_adapters(lora_dirs):
    scheduler = make_scheduler(max_loras=1)
    a, b = lora_request(lora_dirs, "a"), lora_request(lora_dirs, "b")
    scheduler.add_request(request("a1", a))
    scheduler.add_request(request("b1", b))
    scheduler.add_request(request("a2", a))
    first, _ = step(scheduler)
    assert [new.req_id for new in first.scheduled_new_reqs] == ["a1", "a2"]
    finals = run_to_completion(scheduler)
    assert set(finals) == {"a1", "a2", "b1"}
    assert_no_leaked_blocks(scheduler)


def test_bad_lora_requests_get_error_outputs(lora_dirs, tmp_path):
    scheduler = make_scheduler()
    submit(scheduler, request("missing", LoRARequest("x", 5, str(tmp_path / "none"))))
    submit(scheduler, request("huge", lora_request(lora_dirs, "huge")))
    off = make_scheduler(enable_lora=False)
    submit(off, request("off", lora_request(lora_dirs, "a")))
    _, outputs = step(scheduler)
    _, off_outputs = step(off)
    errors = {out.request_id: out.error for out in outputs + off_outputs}
    assert all(out.finish_reason == FinishReason.ERROR for out in outputs + off_outputs)
    assert "adapter_config.json not found" in errors["missing"]
    assert "rank 64, more than --max-lora-rank 16" in errors["huge"]
    assert "not enabled" in errors["off"]
    assert_no_leaked_blocks(scheduler)


def test_prefix_hits_only_under_the_same_adapter(lora_dirs):
    scheduler = make_scheduler(max_loras=2)
    a, b = lora_request(lora_dirs, "a"), lora_request(lora_dirs, "b")
    prompt = list(range(100, 165))  # four full blocks

    def num_cached(req_id, lora) -> int:
        scheduler.add_request(request(req_id, lora, prompt, max_tokens=1))
        finals = run_to_completion(scheduler)
        return finals[req_id].num_cached_tokens

    assert num_cached("a1", a) == 0
    assert num_cached("b1", b) == 0
    assert num_cached("base1", None) == 0
    assert num_cached("a2", a) == 64
    assert num_cached("b2", b) == 64
    assert num_cached("base2", None) == 64
    assert_no_leaked_blocks(scheduler)
