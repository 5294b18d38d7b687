"""A light tenant with a TTFT target beside a heavy tenant without one, under the fair policy
(issue 28's tenants, part (c) of bench/run_slo_sitting.sh), on the real Scheduler with a fake
model and a clock that advances by a simulated CPU's step time: the engine's step-time model
starts from its default prior, as an engine without speculation does (no start-up
measurement), and learns from the measured steps."""

from __future__ import annotations

import msgspec

from kvserve.services.scheduler.core.request import RequestStatus
from kvserve.services.scheduler.core.scheduler import Scheduler
from kvserve.services.scheduler.core.step_time import StepTimeModel, shape_of
from kvserve.shared.messages import SchedulerOutput
from tests.support.kv import assert_no_leaked_blocks
from tests.support.scheduler import create_request, create_scheduler, step

# The simulated machine (a 2-core CPU, as bench/slo_sitting/simulate.py's truth): 40 ms a
# step, 1.4 s per 1k prompt tokens, 4 ms per decode row, 50 ms per 1M attended keys.
CPU = [0.040, 1.4, 0.41, 0.05, 0.41]
LIGHT_TTFT_MS = 1343.0


class _Engine:
    """A fair-policy Scheduler stepped on the simulated CPU: each step takes its time on the
    clock and is recorded, as the engine records it (Scheduler.record_step_time)."""

    def __init__(self) -> None:
        self.scheduler: Scheduler = create_scheduler(
            max_num_batched_tokens=2048,
            max_num_seqs=256,
            scheduling_policy="fair",
            num_blocks=4000,
            max_model_len=4096,
        )
        self.now = 0.0
        self.scheduler.latency.clock = lambda: self.now
        self.cpu = StepTimeModel()
        self.cpu.coefficients = list(CPU)
        self.first_token_at: dict[str, float] = {}

    def add(
        self,
        req_id: str,
        num_tokens: int,
        tenant: str,
        ttft_ms: float | None = None,
        standing_ttft_ms: float | None = None,
    ):
        request = create_request(
            req_id, num_tokens, max_tokens=32, tenant=tenant, arrival_time=self.now
        )
        request = msgspec.structs.replace(
            request, slo_ttft_ms=ttft_ms, standing_ttft_ms=standing_ttft_ms
        )
        self.scheduler.add_request(request)

    def step(self) -> tuple[SchedulerOutput, float]:
        """One step; its output and its seconds on the simulated CPU."""
        scheduler_output, outputs = step(self.scheduler)
        seconds = self.cpu.predict(shape_of(scheduler_output))
        self.now += seconds
        self.scheduler.record_step_time(scheduler_output, seconds)
        for output in outputs:
            if output.new_token_ids:
                self.first_token_at.setdefault(output.request_id, self.now)
        return scheduler_output, seconds


def test_after_one_measured_step_no_step_beside_a_ttft_target_runs_long():
    # The default prior is a GPU's (0.1 s per 1k prompt tokens): on this CPU it predicts a
    # 2,048-token step at under a tenth of its 3 s. The first step, with no target live, takes the
    # whole budget anyway; the light tenant's chat arrives during it. From then on every step
    # must be short enough that a chat arriving during it waits for little (the arrival limit,
    # a quarter of the TTFT target), which needs the model to know the machine after that one
    # step, not after the eight that its regular refit waits for.
    engine = _Engine()
    for i in range(16):
        engine.add(f"heavy{i}", 1024, "heavy")
    _, first_s = engine.step()
    assert first_s > 2.5  # the whole budget
    engine.add("light", 128, "light", ttft_ms=LIGHT_TTFT_MS)
    longest_s = 0.0
    while "light" in engine.scheduler.requests:
        _, seconds = engine.step()
        longest_s = max(longest_s, seconds)
    assert engine.first_token_at["light"] - first_s <= LIGHT_TTFT_MS / 1000
    # A quarter of the target, with room for the model's first, one-step fit.
    assert longest_s <= 2 * LIGHT_TTFT_MS / 1000 / 4
    engine.scheduler.finish_requests(
        list(engine.scheduler.requests), RequestStatus.FINISHED_ABORTED
    )
    assert_no_leaked_blocks(engine.scheduler)


def test_a_key_file_target_cuts_the_first_step_before_any_targeted_request_arrives():
    # The key file gives the light tenant a TTFT target, so the api writes it on every
    # request as standing_ttft_ms, the heavy tenant's too; the workers timed prompt steps at
    # start-up (--slo-step-timing, on by itself with such a key file). The first step, with
    # only the heavy tenant's requests, already leaves room for a chat arriving: it holds a
    # quarter of that target, not the whole budget; the chat that arrives during it meets
    # its target.
    engine = _Engine()
    start_up = [(n, CPU[0] + n * CPU[1] / 1000) for n in (16, 64, 256)]
    engine.scheduler.latency.model = StepTimeModel(start_up)
    for i in range(16):
        engine.add(f"heavy{i}", 1024, "heavy", standing_ttft_ms=LIGHT_TTFT_MS)
    first, first_s = engine.step()
    assert 0 < first.total_num_scheduled_tokens < 1024, first.num_scheduled_tokens
    assert first_s <= LIGHT_TTFT_MS / 1000 / 4 * 1.01
    engine.add("light", 128, "light", ttft_ms=LIGHT_TTFT_MS, standing_ttft_ms=LIGHT_TTFT_MS)
    while "light" not in engine.first_token_at:
        engine.step()
    assert engine.first_token_at["light"] - first_s <= LIGHT_TTFT_MS / 1000
    # Without the standing target (the same start-up timing) the first step is the budget.
    engine = _Engine()
    engine.scheduler.latency.model = StepTimeModel(start_up)
    for i in range(16):
        engine.add(f"heavy{i}", 1024, "heavy")
    first, _ = engine.step()
    assert first.total_num_scheduled_tokens == 2048
    engine.scheduler.finish_requests(
        list(engine.scheduler.requests), RequestStatus.FINISHED_ABORTED
    )
    assert not engine.scheduler.latency._standing_ms
    assert_no_leaked_blocks(engine.scheduler)


def test_on_a_machine_too_slow_for_the_arrival_limit_prompts_still_progress():
    # Ten times the CPU above: the decodes alone take longer than a quarter of the light
    # tenant's TTFT target, so that cap is out of reach. Shrinking the steps to the decodes
    # would leave the heavy tenant's waiting prompts 0 tokens for as long as a target is live
    # (and TARGET_MEMORY_S after): the cap becomes twice the decodes' own step instead.
    engine = _Engine()
    engine.cpu.coefficients = [10 * c for c in CPU]
    for i in range(16):
        engine.add(f"heavy{i}", 1024, "heavy")
    engine.step()  # the whole budget: two heavy prompts, which then decode
    engine.add("light", 128, "light", ttft_ms=LIGHT_TTFT_MS)
    for _ in range(8):  # the model learns the machine
        engine.step()
    prompt_tokens = []  # of each step that holds decodes
    for _ in range(200):
        if "light" not in engine.scheduler.requests:
            break
        scheduler_output, _ = engine.step()
        shape = shape_of(scheduler_output)
        if shape.num_decode_rows:
            prompt_tokens.append(shape.num_prefill_tokens)
    assert "light" not in engine.scheduler.requests
    assert prompt_tokens and min(prompt_tokens) > 0, prompt_tokens
    engine.scheduler.finish_requests(
        list(engine.scheduler.requests), RequestStatus.FINISHED_ABORTED
    )
    assert_no_leaked_blocks(engine.scheduler)
