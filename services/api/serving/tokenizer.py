"""Tokenizer loading and chat templates (transformers' tokenizers, or plain_tokenizer.py's
without transformers; no torch needed)."""

from __future__ import annotations

import json
import os
from functools import cached_property
from typing import Any

from kvserve.services.api.serving.plain_tokenizer import load_plain_tokenizer
from kvserve.shared.logging import init_logger

logger = init_logger(__name__)


class TokenizerInfo:
    """The tokenizer of a resolved model folder plus the ids the engine must know.

    Args:
        model_dir: a folder with tokenizer files and, optionally, generation_config.json.
        chat_template: --chat-template: a Jinja template file, or the template itself; it
            replaces the tokenizer's own.
        config_dir: the model's folder, whose config.json names its architecture (default:
            model_dir; another one when --tokenizer points elsewhere).
        plain: where the folder allows, a PlainTokenizer (plain_tokenizer.py: no transformers
            import, ~1.8 CPU s less at the api's start); else transformers' tokenizer. The
            api server asks for it; `LLM.get_tokenizer()` keeps transformers' type.
    """

    def __init__(
        self,
        model_dir: str,
        chat_template: str | None = None,
        config_dir: str | None = None,
        plain: bool = False,
    ):
        self.model_dir = model_dir
        self.config_dir = config_dir or model_dir
        template = None if chat_template is None else load_chat_template(chat_template)
        self.tokenizer: Any = load_plain_tokenizer(model_dir, template) if plain else None
        if self.tokenizer is not None:
            return
        # The fast tokenizer class loads tokenizer.json without importing torch (transformers'
        # AutoTokenizer does import it): the api process holds no model and no torch.
        tokenizer_cls: Any  # either class; both load with from_pretrained
        if os.path.exists(os.path.join(model_dir, "tokenizer.json")):
            from transformers import PreTrainedTokenizerFast as tokenizer_cls
        else:
            from transformers import AutoTokenizer as tokenizer_cls
        self.tokenizer = tokenizer_cls.from_pretrained(model_dir)
        if template is not None:
            self.tokenizer.chat_template = template

    @cached_property
    def eos_token_id(self) -> int | None:
        return self.tokenizer.eos_token_id

    @cached_property
    def extra_stop_token_ids(self) -> list[int]:
        """EOS ids of generation_config.json beyond the tokenizer's own (Llama 3 has several)."""
        path = os.path.join(self.model_dir, "generation_config.json")
        if not os.path.exists(path):
            return []
        with open(path) as f:
            eos = json.load(f).get("eos_token_id")
        ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
        return [i for i in ids if i != self.eos_token_id]

    @property
    def chat_template_text(self) -> str:
        """The chat template as text (every named template of a tokenizer that has several)."""
        template = getattr(self.tokenizer, "chat_template", None) or ""
        return template if isinstance(template, str) else "\n".join(map(str, template.values()))

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=True)

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **kwargs
    ) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template")
        ids = self.tokenizer.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=add_generation_prompt, **kwargs
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)


def load_chat_template(template: str) -> str:
    """--chat-template's value: the contents of the file it names, or the template itself.

    A value that names no file but looks like a path (no Jinja tags, a template suffix or a
    path separator) is an error, not a template that would render the path as text.
    """
    if os.path.isfile(template):
        with open(template, encoding="utf-8") as f:
            return f.read()
    if "{" not in template and (
        template.endswith((".jinja", ".jinja2", ".j2")) or os.sep in template
    ):
        raise ValueError(f"--chat-template: no such file {template!r}")
    return template
