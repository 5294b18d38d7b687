"""The chat handler's parsers as built at start-up (services/api/surfaces/chat.py): `auto`
resolved against the model folder, harmony switched on for gpt-oss, a text reasoning parser
with its end tag's ids, and /v1/models' card naming both."""

from __future__ import annotations

import json
from types import SimpleNamespace

from kvserve.services.api.serving.tokenizer import TokenizerInfo
from kvserve.services.api.surfaces.chat import OpenAIServingChat
from kvserve.shared.api_config import FrontendConfig
from tests.support.chat_formats import HARMONY_TOKENS, QWEN_TOKENS, write_byte_tokenizer


def chat_over(model_dir: str, model_type: str, frontend: FrontendConfig) -> OpenAIServingChat:
    with open(f"{model_dir}/config.json", "w") as f:
        json.dump({"model_type": model_type}, f)
    client = SimpleNamespace(tokenizer_info=TokenizerInfo(model_dir), model_name="m")
    return OpenAIServingChat(client, "m", frontend)


def test_gpt_oss_gets_harmony_from_auto(tmp_path):
    write_byte_tokenizer(str(tmp_path), HARMONY_TOKENS, "<|return|>", "{{ messages }}")
    chat = chat_over(str(tmp_path), "gpt_oss", FrontendConfig())
    assert chat.harmony is not None and chat.reasoning_parser is None and chat.splits_reasoning
    assert (chat.frontend.tool_call_parser, chat.frontend.reasoning_parser) == (
        "openai",
        "openai_gptoss",
    )
    assert chat.models.model_cards(1024)[0].tool_call_parser is None  # app_context sets it


def test_a_text_reasoning_parser_tokenizes_its_end_tag(tmp_path):
    template = "{% if enable_thinking %}<think>{% endif %}<tool_call>{{ messages }}"
    write_byte_tokenizer(str(tmp_path), QWEN_TOKENS, "<|im_end|>", template)
    chat = chat_over(str(tmp_path), "qwen3", FrontendConfig())
    assert (chat.tool_call_parser, chat.frontend.reasoning_parser) == ("hermes", "qwen3")
    assert chat.harmony is None and chat.splits_reasoning
    assert chat.reasoning_end_token_ids() == chat.tokenizer.encode(
        "</think>", add_special_tokens=False
    )
