"""Beam search (`use_beam_search`, `n` the beam width), run in the api over the engine, as
vLLM runs it, ranked as HF transformers' generate(num_beams=...) ranks.

Each step forks one engine request per live beam: its prompt is the original prompt plus
the beam's tokens, max_tokens 1, greedy, with the top 2 x width logprobs. The engine's
prefix cache holds the shared prompt and the beams' earlier full blocks, so a step computes
little more than one new token per beam. The candidates (a beam and one of its top tokens)
are ranked by cumulative logprob; in rank order, one ending in EOS (or a stop token id)
among the first `width` is a finished beam, the others go on until `width` are live.
Finished beams are scored HF's way: cumulative logprob / generated length **
length_penalty (a final EOS not counted), the best `width` kept. The search ends at
max_tokens, when no beam is live, or when no live beam can beat the worst kept one (HF's
early_stopping=False; with early_stopping true, once `width` beams finished); the live
beams then join the finished ones and the best `width` are the n completions, best first.

Streaming is refused (a beam's text is not final until the search ends), and so are stop
strings, logprobs and structured outputs.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any, Protocol

from kvserve.services.api.serving.errors import APIError
from kvserve.services.api.serving.outputs import CompletionOutput, RequestOutput
from kvserve.shared.sampling_params import SamplingParams

PromptInput = tuple[str | None, list[int]]


class BeamSearchContext(Protocol):
    """What a beam search needs of the serving core (OpenAIServing gives it)."""

    eos_token_id: int | None

    def submit(
        self, request_id: str, prompts: list[PromptInput], params_list: list[SamplingParams]
    ) -> AsyncGenerator[tuple[int, RequestOutput], None]:
        """Run the prompts as engine requests; yield (index, cumulative RequestOutput)."""
        ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool) -> str: ...

    def check(self, output: RequestOutput) -> None:
        """Raise the error of a failed step request."""
        ...


@dataclass(frozen=True, slots=True)
class BeamSearch:
    """A request's beam search.

    Args:
        width: beams kept each step (the request's n).
        length_penalty: the exponent of the length the score divides by.
        early_stopping: stop once `width` beams have finished.
    """

    width: int
    length_penalty: float = 1.0
    early_stopping: bool = False


def beam_search_of(request: Any, max_logprobs: int) -> BeamSearch | None:
    """The request's BeamSearch (None without use_beam_search); a 400 for what beam search
    does not take.

    Args:
        request: a CompletionRequest or ChatCompletionRequest.
        max_logprobs: the engine's --max-logprobs (each step asks for 2 x width).
    """
    if not request.use_beam_search:
        return None
    refused = {
        "stream": request.stream,
        "stop": bool(request.stop),
        "logprobs": getattr(request, "logprobs", None) not in (None, False),
        "structured_outputs": request.structured_outputs is not None
        or request.response_format is not None,
    }
    for field, used in refused.items():
        if used:
            raise APIError(400, f"use_beam_search does not take {field}", field)
    if 2 * request.n > max_logprobs:
        raise APIError(
            400, f"a beam width (n) of at most {max_logprobs // 2} (--max-logprobs)", "n"
        )
    return BeamSearch(request.n, request.length_penalty, request.early_stopping)


@dataclass(slots=True)
class _Beam:
    token_ids: list[int]
    cumulative_logprob: float
    finished: bool = False  # ends in EOS (or a stop token id)


def beam_score(beam: _Beam, length_penalty: float) -> float:
    """HF transformers' hypothesis score: the cumulative logprob over the generated length
    (a final EOS not counted) to the power length_penalty."""
    length = len(beam.token_ids) - (1 if beam.finished else 0)
    return beam.cumulative_logprob / max(length, 1) ** length_penalty


class _Finished:
    """The best `width` finished beams (HF's BeamHypotheses)."""

    def __init__(self, width: int, length_penalty: float):
        self.width, self.length_penalty = width, length_penalty
        self.beams: list[_Beam] = []

    def add(self, beam: _Beam) -> None:
        self.beams.append(beam)
        self.beams.sort(key=lambda b: beam_score(b, self.length_penalty), reverse=True)
        del self.beams[self.width :]

    def is_done(self, best_logprob: float, num_generated: int, early_stopping: bool) -> bool:
        """No live beam can beat the worst kept one (HF's early_stopping=False heuristic),
        or, with early_stopping, `width` beams have finished."""
        if len(self.beams) < self.width:
            return False
        if early_stopping:
            return True
        best_possible = best_logprob / max(num_generated, 1) ** self.length_penalty
        return beam_score(self.beams[-1], self.length_penalty) >= best_possible


async def run_beam_search(
    ctx: BeamSearchContext,
    request_id: str,
    prompt: PromptInput,
    params: SamplingParams,
    beam: BeamSearch,
) -> RequestOutput:
    """The finished RequestOutput of one prompt's beam search: `beam.width` completions.

    Each step ranks the candidates by cumulative logprob and keeps the top 2 x width (as
    HF's generate does over the whole vocabulary: those are within each beam's top 2 x
    width); in rank order, a candidate ending in EOS among the first `width` is a finished
    beam, the others go on until `width` are live.

    Args:
        ctx: how to submit the forked step requests and detokenize.
        request_id: the prompt's id; each step's requests are named after it.
        prompt: (text or None, token ids).
        params: the request's resolved params (max_tokens, ignore_eos, stop_token_ids,
            skip_special_tokens are read).
        beam: the width and the ranking.
    """
    text, prompt_ids = prompt
    stop_ids = set(params.stop_token_ids or [])
    if not params.ignore_eos and ctx.eos_token_id is not None:
        stop_ids.add(ctx.eos_token_id)
    width = beam.width
    step_params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=2 * width)
    live, finished = [_Beam([], 0.0)], _Finished(width, beam.length_penalty)
    assert params.max_tokens is not None, "make_sampling_params resolves max_tokens"
    for step in range(params.max_tokens):
        candidates = await _extend(ctx, f"{request_id}-beam{step}", prompt_ids, live, step_params)
        ranked = sorted(candidates, key=lambda b: b.cumulative_logprob, reverse=True)
        live = []
        for rank, candidate in enumerate(ranked[: 2 * width]):
            candidate.finished = candidate.token_ids[-1] in stop_ids
            if candidate.finished:
                if rank < width:
                    finished.add(candidate)
            elif len(live) < width:
                live.append(candidate)
        best = ranked[0].cumulative_logprob
        if not live or finished.is_done(best, step + 1, beam.early_stopping):
            break
    for candidate in live:
        finished.add(candidate)
    return _final_output(ctx, request_id, text, prompt_ids, params, finished.beams)


async def _extend(
    ctx: BeamSearchContext,
    step_id: str,
    prompt_ids: list[int],
    live: list[_Beam],
    step_params: SamplingParams,
) -> list[_Beam]:
    """Every live beam extended by each of its top tokens: one forked engine request per
    beam (its prompt the prompt plus the beam's tokens, mostly prefix-cache hits)."""
    candidates = []
    prompts: list[PromptInput] = [(None, prompt_ids + b.token_ids) for b in live]
    async for index, output in ctx.submit(step_id, prompts, [step_params] * len(live)):
        if not output.finished:
            continue
        ctx.check(output)
        top = output.outputs[0].logprobs
        assert top, "each step asks for logprobs"
        parent = live[index]
        for token_id, logprob in top[0].items():
            candidates.append(
                _Beam(parent.token_ids + [token_id], parent.cumulative_logprob + logprob.logprob)
            )
    return candidates


def _final_output(
    ctx: BeamSearchContext,
    request_id: str,
    text: str | None,
    prompt_ids: list[int],
    params: SamplingParams,
    best: list[_Beam],
) -> RequestOutput:
    """The completions, best first (`best` is sorted)."""
    outputs = [
        CompletionOutput(
            index=i,
            text=ctx.decode(b.token_ids, params.skip_special_tokens),
            token_ids=b.token_ids,
            cumulative_logprob=b.cumulative_logprob,
            finish_reason="stop" if b.finished else "length",
            stop_reason=b.token_ids[-1] if b.finished and b.token_ids else None,
        )
        for i, b in enumerate(best)
    ]
    return RequestOutput(request_id, text, prompt_ids, outputs, finished=True)


async def beam_search_results(
    ctx: BeamSearchContext,
    request_id: str,
    prompts: list[PromptInput],
    params_list: list[SamplingParams],
    beam: BeamSearch,
) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """(prompt index, finished RequestOutput) of each prompt's beam search, in order."""
    for index, (prompt, params) in enumerate(zip(prompts, params_list, strict=True)):
        prompt_id = request_id if len(prompts) == 1 else f"{request_id}-{index}"
        yield index, await run_beam_search(ctx, prompt_id, prompt, params, beam)
