"""The worker's side of images in the prompt: the vision encoder runs, its cache, and the
step's image embeddings and M-RoPE positions (services/worker/models/qwen2_5_vl.py).

Each step, the encoder runs on the images the scheduler put in it
(`SchedulerOutput.scheduled_encoder_inputs`, within its encoder budget) and keeps each
image's output until the request's computed tokens pass the image's end; the scheduler frees
its encoder budget by that same rule (services/scheduler/core/encoder_budget.py). A prefill
chunk may end inside an image: the next chunk takes the rest of the image's rows from the
cache. An image's placeholder rows in the flattened batch are

    rows = query_start + (max(start, offset) .. min(start + n, offset + length)) - start

for a request computing tokens [start, start + n).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvserve.services.worker.models.qwen2_5_vl import MultimodalInputs, mrope_positions
from kvserve.services.worker.step_inputs import StepBatch
from kvserve.shared.messages import ImageInput, NewRequestData


@dataclass
class RequestImages:
    """A request's images, its prompt's M-RoPE positions [3, P] and the delta of every
    later token (position = index + delta)."""

    images: list[ImageInput]
    positions: np.ndarray
    delta: int


class MultimodalRunner:
    """Per-request image state and the encoder cache of one worker.

    Args:
        model: a model with `supports_images` (embed_image, spatial_merge_size).
        device: where the encoder's outputs live.
    """

    def __init__(self, model, device: torch.device):
        self.model = model
        self.device = device
        self.requests: dict[str, RequestImages] = {}
        # (request id, image index) -> [length, hidden] encoder output
        self.encoder_cache: dict[tuple[str, int], torch.Tensor] = {}
        self.encoder_seconds = 0.0  # summed encoder time (bench/vision.py reads it)

    def add_request(self, new: NewRequestData) -> None:
        if not new.mm_inputs:
            return
        images = [
            (m.offset, m.length, (m.grid_thw[0], m.grid_thw[1], m.grid_thw[2]))
            for m in new.mm_inputs
        ]
        positions, delta = mrope_positions(
            new.prompt_token_ids, images, self.model.spatial_merge_size
        )
        self.requests[new.req_id] = RequestImages(list(new.mm_inputs), positions, delta)

    def remove_request(self, req_id: str) -> None:
        state = self.requests.pop(req_id, None)
        if state is not None:
            for index in range(len(state.images)):
                self.encoder_cache.pop((req_id, index), None)

    def prepare(self, step: StepBatch) -> MultimodalInputs | None:
        """Run the step's encoder inputs, then shift the step's positions (in place) and
        gather its image embeddings; None when no request of the step has images."""
        for req_id, indices in step.so.scheduled_encoder_inputs.items():
            for index in indices:
                self._encode(req_id, index)
        if not self.requests or not any(r in self.requests for r in step.req_ids):
            return None
        positions = step.positions.cpu().numpy().copy()
        mrope: np.ndarray | None = None
        embeds, embed_rows = [], []
        for i, req_id in enumerate(step.req_ids):
            state = self.requests.get(req_id)
            if state is None:
                continue
            start, n = int(step.num_computed[i]), int(step.num_scheduled[i])
            q0 = int(step.query_start_loc[i])
            token_index = np.arange(start, start + n)
            in_prompt = token_index < state.positions.shape[1]
            rows = np.repeat((token_index + state.delta)[None, :], 3, axis=0)
            rows[:, in_prompt] = state.positions[:, token_index[in_prompt]]
            positions[q0 : q0 + n] = rows[0]
            for k, image in enumerate(state.images):
                lo, hi = max(start, image.offset), min(start + n, image.end)
                if lo >= hi:
                    continue
                cached = self.encoder_cache.get((req_id, k))
                assert cached is not None, f"image {k} of {req_id} was not encoded"
                embeds.append(cached[lo - image.offset : hi - image.offset])
                embed_rows.append(np.arange(q0 + lo - start, q0 + hi - start))
                if mrope is None:
                    mrope = np.repeat(positions[None, :], 3, axis=0)
            if mrope is not None:
                mrope[:, q0 : q0 + n] = rows
        step.positions = torch.from_numpy(positions).to(self.device)
        out = MultimodalInputs()
        if embeds:
            out.embeds = torch.cat(embeds)
            out.embed_rows = torch.from_numpy(np.concatenate(embed_rows)).to(self.device)
        if mrope is not None:
            out.mrope_positions = torch.from_numpy(mrope).to(self.device)
        return out

    def after_step(self, step: StepBatch) -> None:
        """Drop the encoder outputs whose image the step finished computing."""
        if not self.encoder_cache:
            return
        for i, req_id in enumerate(step.req_ids):
            state = self.requests.get(req_id)
            if state is None:
                continue
            done = int(step.num_computed[i]) + int(step.num_scheduled[i])
            for k, image in enumerate(state.images):
                if image.end <= done:
                    self.encoder_cache.pop((req_id, k), None)

    def _encode(self, req_id: str, index: int) -> None:
        import time

        image = self.requests[req_id].images[index]
        array = np.frombuffer(image.pixel_values, dtype=np.dtype(image.dtype))
        pixels = torch.from_numpy(array.reshape(image.shape).copy())
        start = time.perf_counter()
        output = self.model.embed_image(pixels, image.grid_thw)
        if output.shape[0] != image.length:
            raise ValueError(
                f"image {index} of {req_id} has {image.length} placeholder tokens but its "
                f"encoder gave {output.shape[0]} embeddings"
            )
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.encoder_seconds += time.perf_counter() - start
        self.encoder_cache[(req_id, index)] = output
