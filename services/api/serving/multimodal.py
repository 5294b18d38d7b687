"""Images in the prompt, the api's half: fetch, decode, preprocess, expand placeholders.

An image arrives as a chat `image_url` part (or an Anthropic `image` block): a `data:` URL
(base64 PNG / JPEG / ...), or a `file://` URL or path under `--allowed-local-media-path`.
Remote http(s) URLs are refused: the server reaches no network. `--limit-mm-per-prompt`
('{"image": 2}') caps the images of one request.

Preprocessing is the model folder's HF image processor (`AutoImageProcessor`, PIL backend
when torchvision is absent), run here so the engine receives pixels ready for the vision
encoder. transformers' whole `AutoProcessor` is not used: for Qwen2.5-VL it also loads a
video processor, which needs torchvision; its text half is one rule this module applies to
the token ids: each image placeholder token becomes t*h*w / merge**2 copies of itself.

Each image travels as an `ImageInput` (pixel bytes, dtype, shape, grid, its token span and
a content hash that keys the prefix cache).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
import os
from typing import Any
from urllib.parse import unquote, urlparse

from kvserve.shared.messages import ImageInput


class MultimodalError(ValueError):
    """A request's image is refused (the api answers 400 with this message)."""


class PromptWithImages(list):
    """A prompt's token ids that carry its images: the serving path hands token ids through
    unchanged to the EngineCoreRequest (services/api/serving/output_processor.py), which takes
    `mm_inputs` from here."""

    def __init__(self, token_ids: list[int], mm_inputs: list[ImageInput]):
        super().__init__(token_ids)
        self.mm_inputs = mm_inputs


def load_image_bytes(url: str, allowed_local_media_path: str | None) -> bytes:
    """The encoded bytes an image URL names (data: or a local file under the allowed folder)."""
    if url.startswith("data:"):
        header, sep, payload = url.partition(",")
        if not sep or ";base64" not in header:
            raise MultimodalError("an image data: URL must be base64 (data:image/png;base64,...)")
        if not header[5:].startswith("image/"):
            raise MultimodalError(f"a data: URL of type {header[5:].split(';')[0]!r} is no image")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise MultimodalError(f"the image data: URL is not valid base64: {exc}") from None
    parsed = urlparse(url)
    if parsed.scheme in ("http", "https"):
        raise MultimodalError(
            f"remote image URLs are not fetched ({parsed.scheme}://{parsed.netloc}): this server "
            "reaches no network; send the image as a data: URL or a local file under "
            "--allowed-local-media-path"
        )
    if parsed.scheme not in ("file", ""):
        raise MultimodalError(f"unsupported image URL scheme {parsed.scheme!r}")
    if allowed_local_media_path is None:
        raise MultimodalError(
            "local image files are refused: start the server with --allowed-local-media-path"
        )
    path = os.path.realpath(unquote(parsed.path) if parsed.scheme == "file" else url)
    root = os.path.realpath(allowed_local_media_path)
    if os.path.commonpath([path, root]) != root:
        raise MultimodalError(f"image file {path!r} is outside --allowed-local-media-path")
    if not os.path.isfile(path):
        raise MultimodalError(f"no image file {path!r}")
    with open(path, "rb") as f:
        return f.read()


def decode_image(data: bytes) -> Any:
    """A PIL RGB image from encoded bytes; MultimodalError when they are no image."""
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise MultimodalError(f"the image could not be decoded: {exc}") from None
    return image.convert("RGB")


class ImageProcessor:
    """A model folder's image preprocessing and its placeholder rule.

    Args:
        model_dir: the model folder (preprocessor_config.json, config.json).
    """

    def __init__(self, model_dir: str):
        from transformers import AutoConfig, AutoImageProcessor

        config = AutoConfig.from_pretrained(model_dir)
        self.image_token_id = int(config.image_token_id)
        self.processor = AutoImageProcessor.from_pretrained(model_dir)
        self.merge_size = int(getattr(self.processor, "merge_size", 1))

    def num_tokens(self, grid_thw: list[int]) -> int:
        t, h, w = grid_thw
        return t * h * w // self.merge_size**2

    def preprocess(self, image: Any) -> tuple[Any, list[int]]:
        """(flattened patches as a float32 numpy array, [t, h, w] patch grid)."""
        out = self.processor(images=[image], return_tensors="np")
        return out["pixel_values"].astype("float32"), [int(x) for x in out["image_grid_thw"][0]]

    def expand(self, token_ids: list[int], images: list[Any]) -> tuple[list[int], list[ImageInput]]:
        """Preprocess `images` and expand the prompt's placeholders, one per image in order,
        to each image's token count; returns (prompt, one ImageInput per image)."""
        placeholder = self.image_token_id
        num_placeholders = sum(1 for t in token_ids if t == placeholder)
        if num_placeholders != len(images):
            raise MultimodalError(
                f"the prompt has {num_placeholders} image placeholders for {len(images)} images"
            )
        out: list[int] = []
        inputs = []
        it = iter(images)
        for token in token_ids:
            if token != placeholder:
                out.append(token)
                continue
            pixels, grid = self.preprocess(next(it))
            length = self.num_tokens(grid)
            digest = hashlib.sha256()
            digest.update(json.dumps([str(pixels.dtype), list(pixels.shape), grid]).encode())
            digest.update(pixels.tobytes())
            inputs.append(
                ImageInput(
                    pixel_values=pixels.tobytes(),
                    dtype=str(pixels.dtype),
                    shape=list(pixels.shape),
                    grid_thw=grid,
                    offset=len(out),
                    length=length,
                    mm_hash=digest.hexdigest(),
                )
            )
            out.extend([placeholder] * length)
        return out, inputs


def load_image_processor(model_dir: str) -> ImageProcessor | None:
    """The folder's ImageProcessor; None for a model without one (text only)."""
    if not os.path.exists(os.path.join(model_dir, "preprocessor_config.json")):
        return None
    with open(os.path.join(model_dir, "config.json")) as f:
        if "image_token_id" not in json.load(f):
            return None
    return ImageProcessor(model_dir)
