"""`auto` parsers (services/api/parsers/auto.py): each family's config and chat template
markers pick vLLM's parser for it; an explicit name wins; an unknown model gets none, said
once in the log; the front end's options come back resolved."""

from __future__ import annotations

import json
import logging

import pytest

from kvserve.services.api.parsers.auto import (
    ModelFacts,
    choose_parsers,
    read_model_facts,
    resolved_parsers,
)
from kvserve.shared.api_config import FrontendConfig

# Each family's chat template reduced to the markers auto reads (the snippets are copied
# from the family's own template: the model repos named beside them).
FAMILIES = [
    # openai/gpt-oss-20b: harmony (the template writes <|channel|>, but model_type decides).
    ("gpt_oss", "<|start|>assistant<|channel|>final<|message|>", "openai", "openai_gptoss"),
    # mistralai/Magistral-Small-2509: [TOOL_CALLS] and [THINK].
    ("mistral", "[TOOL_CALLS]{{ name }}[ARGS]{{ args }} [THINK]", "mistral", "mistral"),
    # mistralai/Mistral-Small-3.2-24B-Instruct-2506: [TOOL_CALLS], no thinking.
    ("mistral3", "[AVAILABLE_TOOLS]{{ tools }}[TOOL_CALLS]", "mistral", None),
    # Qwen/Qwen3-Coder-30B-A3B-Instruct: XML calls.
    ("qwen3_moe", "<tool_call>\n<function={{ name }}>\n<parameter={{ k }}>", "qwen3_coder", None),
    # Qwen/Qwen3-8B: hermes calls, <think> with enable_thinking.
    (
        "qwen3",
        "<tool_call>{{ call | tojson }}</tool_call>{% if enable_thinking is defined %}<think>",
        "hermes",
        "qwen3",
    ),
    # Qwen/Qwen2.5-7B-Instruct: hermes calls, no thinking.
    ("qwen2", "<tool_call>\n{{ call | tojson }}\n</tool_call>", "hermes", None),
    # zai-org/GLM-4.5: <arg_key> calls and <think>.
    (
        "glm4_moe",
        "<tool_call>{{ name }}<arg_key>{{ k }}</arg_key><think></think>",
        "glm45",
        "glm45",
    ),
    # moonshotai/Kimi-K2-Thinking: sections and <think>.
    ("kimi_k2", "<|tool_calls_section_begin|><think>{{ r }}</think>", "kimi_k2", "kimi_k2"),
    # moonshotai/Kimi-K2-Instruct: sections, no thinking.
    ("kimi_k2", "<|tool_calls_section_begin|><|tool_call_begin|>", "kimi_k2", None),
    # deepseek-ai/DeepSeek-R1-0528: V3's calls with ```json, <think> opened in the prompt.
    (
        "deepseek_v3",
        "<｜Assistant｜><｜tool▁calls▁begin｜>function<｜tool▁sep｜>```json<think>\\n",
        "deepseek_v3",
        "deepseek_r1",
    ),
    # deepseek-ai/DeepSeek-V3.1: plain calls, the thinking flag.
    (
        "deepseek_v3",
        "{% if thinking is defined and thinking %}<｜Assistant｜><think>{% endif %}"
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>{{ name }}<｜tool▁sep｜>",
        "deepseek_v31",
        "deepseek_v3",
    ),
    # meta-llama/Llama-4-Scout-17B-16E-Instruct: pythonic.
    ("llama4", "<|python_start|>{{ code }}<|python_end|>", "llama4_pythonic", None),
    # meta-llama/Llama-3.1-8B-Instruct: JSON after <|python_tag|>.
    ("llama", "<|python_tag|>{{ call }}<|eom_id|>", "llama3_json", None),
    # HuggingFaceTB/SmolLM2-135M-Instruct: a chat template with no tool or thinking markup.
    ("llama", "<|im_start|>{{ role }}\n{{ content }}<|im_end|>", None, None),
]


@pytest.mark.parametrize("model_type, template, tool, reasoning", FAMILIES)
def test_each_family_gets_vllms_parser(model_type, template, tool, reasoning):
    facts = ModelFacts(model_type, (), template)
    assert choose_parsers("auto", "auto", facts) == (tool, reasoning)


def test_an_explicit_name_wins_and_none_stays_none():
    facts = ModelFacts("qwen3", "<tool_call><think>enable_thinking", "")
    assert choose_parsers("pythonic", None, facts) == ("pythonic", None)
    assert choose_parsers("auto", "deepseek_r1", facts) == (None, "deepseek_r1")


def test_an_unknown_model_gets_none_and_says_so_once(caplog):
    with caplog.at_level(logging.INFO, logger="kvserve"):
        assert choose_parsers("auto", "auto", ModelFacts("", (), "")) == (None, None)
    lines = [r.getMessage() for r in caplog.records if "auto:" in r.getMessage()]
    assert len(lines) == 2 and all("no " in line and "serving without" in line for line in lines)


def test_the_front_end_options_come_back_resolved(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt_oss"}))
    facts = read_model_facts(str(tmp_path), "template")
    assert facts.model_type == "gpt_oss" and facts.chat_template == "template"

    class Info:
        config_dir = str(tmp_path)
        chat_template_text = "<tool_call>"

    resolved = resolved_parsers(FrontendConfig(), Info())
    assert (FrontendConfig().tool_call_parser, FrontendConfig().reasoning_parser) == (
        "auto",
        "auto",
    )
    assert (resolved.tool_call_parser, resolved.reasoning_parser) == ("openai", "openai_gptoss")
    explicit = FrontendConfig(tool_call_parser="hermes", reasoning_parser="qwen3")
    assert resolved_parsers(explicit, Info()) is explicit
