"""A tiny random-weight Qwen2.5-VL (vision tower tiny too) with a processor that loads offline.

The tokenizer is the tiny Llama's byte-level BPE (tests/support/models.py) plus Qwen's
chat and vision special tokens; the chat template is a short Qwen-style one that places
`<|vision_start|><|image_pad|><|vision_end|>` for each image part. The image processor is
transformers' PIL one (`Qwen2VLImageProcessorPil`: no torchvision), with 14-pixel patches
merged 2x2, so a 448x448 image is a 32x32 patch grid and 256 image tokens.
"""

from __future__ import annotations

import json
import os

import numpy as np

from kvserve.shared.messages import ImageInput
from tests.support.models import random_hf_model

EOS = "<|endoftext|>"
SPECIAL_TOKENS = [
    EOS,
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
EOS_ID = 256
IM_END_ID = 258
VISION_START_ID = 259
VISION_END_ID = 260
IMAGE_TOKEN_ID = 261
VIDEO_TOKEN_ID = 262
VOCAB_SIZE = 264
# Pixels per image the processor allows: a 448x448 image keeps its size.
MAX_PIXELS = 448 * 448
# Tokens the tests generate (HF's greedy, then ours).
MAX_TOKENS = 8

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# A small random model for timings (bench/vision.py): a 4-layer 512-wide decoder and an
# 8-block 256-wide vision tower (window attention, two full-attention blocks).
SMALL_TEXT = dict(
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [8, 12, 12]},
)
SMALL_VISION = dict(
    depth=8,
    hidden_size=256,
    intermediate_size=768,
    num_heads=4,
    out_hidden_size=512,
    window_size=112,
    fullatt_block_indexes=[3, 7],
)


def tiny_vlm_config(text: dict | None = None, vision: dict | None = None):
    """The tiny Qwen2.5-VL config; `text` and `vision` override its sub-configs' fields."""
    from transformers import Qwen2_5_VLConfig

    text_overrides, vision_overrides = text, vision

    text = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        # head_dim 16: 8 frequencies split t / h / w
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        tie_word_embeddings=False,
        eos_token_id=EOS_ID,
        bos_token_id=None,
    )
    text.update(text_overrides or {})
    vision = dict(
        depth=2,
        hidden_size=32,
        intermediate_size=48,
        num_heads=2,
        out_hidden_size=64,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=56,
        fullatt_block_indexes=[1],
        in_channels=3,
    )
    vision.update(vision_overrides or {})
    fields = dict(
        text_config=text,
        vision_config=vision,
        image_token_id=IMAGE_TOKEN_ID,
        video_token_id=VIDEO_TOKEN_ID,
        vision_start_token_id=VISION_START_ID,
        vision_end_token_id=VISION_END_ID,
        tie_word_embeddings=False,
    )
    return Qwen2_5_VLConfig(**fields)


def make_tiny_vlm(seed: int = 0, small: bool = False):
    """The HF Qwen2_5_VLForConditionalGeneration with random weights (eager attention);
    `small`: the SMALL_TEXT / SMALL_VISION sizes."""
    import transformers as tf

    config = tiny_vlm_config(SMALL_TEXT, SMALL_VISION) if small else tiny_vlm_config()
    model = random_hf_model(lambda **_: config, tf.Qwen2_5_VLForConditionalGeneration, {}, seed)
    model.config._attn_implementation = "eager"
    for sub in (model.config.text_config, model.config.vision_config):
        sub._attn_implementation = "eager"
    model.generation_config.eos_token_id = EOS_ID
    model.generation_config.pad_token_id = EOS_ID
    return model


def write_tokenizer(model_dir: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {symbol: index for index, symbol in enumerate(alphabet)}
    for i, token in enumerate(SPECIAL_TOKENS):
        vocab[token] = EOS_ID + i
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    tokenizer.save(os.path.join(model_dir, "tokenizer.json"))
    with open(os.path.join(model_dir, "tokenizer_config.json"), "w") as f:
        json.dump(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": EOS,
                "pad_token": EOS,
                "model_max_length": 1024,
                "chat_template": CHAT_TEMPLATE,
            },
            f,
        )


def write_processor(model_dir: str) -> None:
    """preprocessor_config.json (the PIL image processor) and processor_config.json."""
    image = dict(
        image_processor_type="Qwen2VLImageProcessor",
        patch_size=14,
        merge_size=2,
        temporal_patch_size=2,
        min_pixels=56 * 56,
        max_pixels=MAX_PIXELS,
        do_resize=True,
        do_rescale=True,
        do_normalize=True,
        do_convert_rgb=True,
        image_mean=[0.48145466, 0.4578275, 0.40821073],
        image_std=[0.26862954, 0.26130258, 0.27577711],
    )
    with open(os.path.join(model_dir, "preprocessor_config.json"), "w") as f:
        json.dump(image, f)
    with open(os.path.join(model_dir, "processor_config.json"), "w") as f:
        json.dump({"processor_class": "Qwen2_5_VLProcessor"}, f)
    with open(os.path.join(model_dir, "chat_template.json"), "w") as f:
        json.dump({"chat_template": CHAT_TEMPLATE}, f)


def save_tiny_vlm(model_dir: str, seed: int = 0, small: bool = False):
    """Save the tiny (or small) model, its tokenizer and processor in model_dir; return the
    HF model."""
    os.makedirs(model_dir, exist_ok=True)
    model = make_tiny_vlm(seed, small)
    model.save_pretrained(model_dir)
    write_tokenizer(model_dir)
    write_processor(model_dir)
    return model


def random_image(height: int, width: int, seed: int):
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def chat_prompt(model_dir: str, num_images: int, text: str) -> list[int]:
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)
    content = [{"type": "image"}] * num_images + [{"type": "text", "text": text}]
    messages = [{"role": "user", "content": content}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def hf_greedy(hf_model, prompt: list[int], mm: list[ImageInput]):
    """HF's greedy generate of MAX_TOKENS tokens with the same pixels: (tokens, [steps,
    vocab] log-softmax of each step's raw logits)."""
    import torch

    input_ids = torch.tensor([prompt])
    pixels = [
        torch.from_numpy(np.frombuffer(m.pixel_values, dtype=m.dtype).reshape(m.shape).copy())
        for m in mm
    ]
    with torch.no_grad():
        out = hf_model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            mm_token_type_ids=(input_ids == IMAGE_TOKEN_ID).int(),
            pixel_values=torch.cat(pixels),
            image_grid_thw=torch.tensor([m.grid_thw for m in mm]),
            max_new_tokens=MAX_TOKENS,
            min_new_tokens=MAX_TOKENS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    logprobs = torch.log_softmax(torch.stack(out.logits)[:, 0].float(), dim=-1)
    return tokens, logprobs
