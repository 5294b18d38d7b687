"""The chat prompts the default model's e2e comparisons (against HF transformers, and of the
quantized weights against the float32 expansion) decode."""

from __future__ import annotations

from kvserve.benchmarks.datasets import CHAT_QUESTIONS

QUESTIONS = CHAT_QUESTIONS[:16]  # bench/quantized.py's prompts too
MAX_TOKENS = 64


def chat_prompt_ids(model_dir: str, questions: list[str] | None = None) -> list[list[int]]:
    """Token ids of each question (QUESTIONS by default) as a user message, under
    model_dir's chat template."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return [
        list(
            tok.apply_chat_template(
                [{"role": "user", "content": q}],
                tokenize=True,
                add_generation_prompt=True,
                return_dict=False,
            )
        )
        for q in (QUESTIONS if questions is None else questions)
    ]
