"""Quantize the default model (SmolLM2-135M's float folder, converted from the shipped GGUF)
to compressed-tensors W4A16 with llm-compressor's GPTQModifier, for bench/int4.py.

Run in a venv with llm-compressor (not the project's: it pins its own transformers):

    SRC=$(.venv/bin/python -c "from kvserve.services.worker.model_loader import \\
        resolve_model; print(resolve_model(None))")
    /tmp/int4tools/bin/python bench/make_w4a16.py $SRC $KVSERVE_CACHE_DIR/smollm2-w4a16-g64
    /tmp/int4tools/bin/python bench/make_w4a16.py --rtn $SRC $KVSERVE_CACHE_DIR/smollm2-w4a16-rtn
        (data-free round to nearest, llm-compressor's QuantizationModifier)

Group 64, not the W4A16 preset's 128: SmolLM2-135M's hidden size 576 is 4.5 groups of 128.
The LM head (tied to the embedding) stays float. Calibration: 16 chat-style sentences, 128
tokens at most.
"""

from __future__ import annotations

import sys

SENTENCES = [
    "What is the capital of France? The capital of France is Paris.",
    "Explain how a rainbow forms in simple words.",
    "Write a short poem about the ocean at night.",
    "How do plants make their food? Through photosynthesis, using sunlight.",
    "List three tips for staying focused while studying.",
    "What is the difference between weather and climate?",
    "Describe the water cycle in a few sentences.",
    "Why is the sky blue during the day and red at sunset?",
    "Give me a recipe for a simple tomato soup.",
    "What are the planets of the solar system, in order from the sun?",
    "Translate 'good morning' into Spanish and French.",
    "Summarize the plot of a classic fairy tale in two sentences.",
    "How does a computer store numbers in memory?",
    "What should I pack for a weekend hiking trip?",
    "Explain what a neural network is to a ten-year-old.",
    "Why do we have seasons on Earth?",
]


def main_rtn(src: str, out: str) -> None:
    """The same scheme by llm-compressor's data-free QuantizationModifier (round to nearest:
    minutes less than GPTQ on a loaded 2-core machine)."""
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
               "group_size": 64}  # fmt: skip
    recipe = QuantizationModifier(
        config_groups={"group_0": {"targets": ["Linear"], "weights": weights}},
        ignore=["lm_head"],
    )
    model = AutoModelForCausalLM.from_pretrained(src, dtype="float32")
    oneshot(model=model, recipe=recipe)
    model.save_pretrained(out, save_compressed=True)
    AutoTokenizer.from_pretrained(src).save_pretrained(out)


def main(src: str, out: str) -> None:
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(src)
    texts = [
        tokenizer.apply_chat_template([{"role": "user", "content": s}], tokenize=False) + s
        for s in SENTENCES
    ]
    encoded = tokenizer(texts, truncation=True, max_length=128)
    dataset = Dataset.from_dict(dict(encoded))
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
               "group_size": 64}  # fmt: skip
    recipe = GPTQModifier(
        config_groups={"group_0": {"targets": ["Linear"], "weights": weights}},
        ignore=["lm_head"],
    )
    model = oneshot(model=src, processor=tokenizer, dataset=dataset, recipe=recipe,
                    num_calibration_samples=len(texts), max_seq_length=128)  # fmt: skip
    model.save_pretrained(out, save_compressed=True)
    tokenizer.save_pretrained(out)


if __name__ == "__main__":
    if sys.argv[1] == "--rtn":
        main_rtn(sys.argv[2], sys.argv[3])
    else:
        main(sys.argv[1], sys.argv[2])
