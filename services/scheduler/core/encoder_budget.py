"""The encoder budget: which images' vision encoder runs in a step (vLLM's shape).

A step may compute image tokens only once their image's encoder output exists in the
worker. Each step the encoder may compute `--max-num-encoder-input-tokens` image tokens
(default: the step's token budget), and the worker keeps those outputs (the encoder cache,
of the same size) until the request's computed tokens pass the image's end. So when a
prompt chunk reaches an image that is neither cached nor affordable this step, the chunk
ends before the image, at a token boundary: Qwen2.5-VL's attention is causal over image
tokens too, so a chunk may also end inside an image, whose rest the next chunk takes from
the cache. An image larger than the budget runs alone in its step (else it never would).

Bookkeeping mirrors the worker (services/worker/multimodal.py): scheduled here, encoded
there in the same step; freed here after the step that computes the image's last token,
dropped there after that step's forward; both drop a preempted or finished request's.
"""

from __future__ import annotations

from kvserve.services.scheduler.core.request import Request


class EncoderBudget:
    """Encoder tokens per step and encoder outputs held, in image tokens.

    Args:
        tokens_per_step: image tokens the encoder may compute in one step.
        cache_size: image tokens the worker's encoder cache may hold.
    """

    def __init__(self, tokens_per_step: int, cache_size: int):
        self.tokens_per_step = tokens_per_step
        self.cache_size = cache_size
        self.cached: dict[str, set[int]] = {}  # request id -> image indices the worker holds
        self.num_cached_tokens = 0
        self.step_left = tokens_per_step
        self.pending: dict[str, list[int]] = {}  # fitted, not yet scheduled

    def start_step(self) -> None:
        self.step_left = self.tokens_per_step
        self.pending.clear()

    def fit(self, request: Request, start: int, num_new_tokens: int) -> int:
        """num_new_tokens cut before the first image in [start, start + n) that is neither
        cached nor affordable in this step; the images to encode wait in `pending` for
        `commit` (the request may still not be scheduled)."""
        cached = self.cached.get(request.req_id, ())
        step_left = self.step_left
        cache_left = self.cache_size - self.num_cached_tokens
        to_encode = []
        for index, image in enumerate(request.mm_inputs):
            if image.offset >= start + num_new_tokens:
                break
            if image.end <= start or index in cached:
                continue
            alone = step_left == self.tokens_per_step and self.num_cached_tokens == 0
            if not alone and (image.length > step_left or image.length > cache_left):
                num_new_tokens = image.offset - start if image.offset > start else 0
                break
            to_encode.append(index)
            step_left -= image.length
            cache_left -= image.length
        self.pending[request.req_id] = to_encode
        return num_new_tokens

    def commit(self, request: Request) -> list[int]:
        """The request was scheduled: its fitted images run in this step."""
        to_encode = self.pending.pop(request.req_id, [])
        if to_encode:
            cached = self.cached.setdefault(request.req_id, set())
            for index in to_encode:
                length = request.mm_inputs[index].length
                cached.add(index)
                self.step_left -= length
                self.num_cached_tokens += length
        return to_encode

    def release_computed(self, request: Request) -> None:
        """Free the outputs whose image the request's computed tokens now cover."""
        cached = self.cached.get(request.req_id)
        if not cached:
            return
        for index in [i for i in cached if request.mm_inputs[i].end <= request.num_computed_tokens]:
            cached.discard(index)
            self.num_cached_tokens -= request.mm_inputs[index].length

    def free(self, request: Request) -> None:
        """The request was preempted or finished: the worker drops its outputs."""
        self.pending.pop(request.req_id, None)
        for index in self.cached.pop(request.req_id, ()):
            self.num_cached_tokens -= request.mm_inputs[index].length
