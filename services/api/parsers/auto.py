"""`auto` (the default of --tool-call-parser and --reasoning-parser): the parsers a model
needs, read from its config.json (architectures / model_type) and its chat template's
markers, decided once at start-up and logged; an explicit name always wins.

    what the model shows                                tool parser       reasoning parser
    model_type gpt_oss                                  openai            openai_gptoss
    template writes [TOOL_CALLS] ([THINK])              mistral           (mistral)
    template writes <function=...><parameter=...>       qwen3_coder       -
    template writes <arg_key>                           glm45             glm45 (<think>)
    template writes <|tool_calls_section_begin|>        kimi_k2           kimi_k2 (<think>)
    template writes <｜tool▁calls▁begin｜> + ```json      deepseek_v3       deepseek_r1 (<think>)
    template writes <｜tool▁calls▁begin｜>, no ```json    deepseek_v31      deepseek_v3 (thinking)
    model_type llama4, or <|python_start|>              llama4_pythonic   -
    template writes <|python_tag|>                      llama3_json       -
    template writes <tool_call>                         hermes            qwen3 (enable_thinking)

A model that matches no row gets no parser, and the log says so once (tool_choice "auto"
then answers 400, as without a parser).
"""

from __future__ import annotations

import json
import os
from typing import Any, NamedTuple

import msgspec

from kvserve.shared.api_config import FrontendConfig
from kvserve.shared.logging import init_logger
from kvserve.shared.parser_names import REASONING_PARSER_NAMES, TOOL_CALL_PARSER_NAMES

logger = init_logger(__name__)

AUTO = "auto"


class ModelFacts(NamedTuple):
    """What auto reads: the config's model_type and architectures, and the chat template."""

    model_type: str
    architectures: tuple[str, ...]
    chat_template: str


class ParserChoice(NamedTuple):
    tool_call_parser: str | None
    reasoning_parser: str | None


def read_model_facts(config_dir: str, chat_template: str | None) -> ModelFacts:
    """The facts of a model folder (a folder without config.json has none)."""
    config: dict[str, Any] = {}
    path = os.path.join(config_dir, "config.json")
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    model_type = str(config.get("model_type") or "")
    text_config = config.get("text_config")
    if isinstance(text_config, dict) and not model_type.startswith("llama4"):
        model_type = model_type or str(text_config.get("model_type") or "")
    return ModelFacts(model_type, tuple(config.get("architectures") or ()), chat_template or "")


def auto_tool_call_parser(facts: ModelFacts) -> str | None:
    """The tool-call format the model writes (None: none known)."""
    template = facts.chat_template
    if facts.model_type == "gpt_oss":
        return "openai"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<function=" in template and "<parameter=" in template:
        return "qwen3_coder"
    if "<arg_key>" in template:
        return "glm45"
    if "<|tool_calls_section_begin|>" in template:
        return "kimi_k2"
    if "tool▁calls▁begin" in template:
        return "deepseek_v3" if "```json" in template else "deepseek_v31"
    if facts.model_type == "llama4" or "<|python_start|>" in template:
        return "llama4_pythonic"
    if "<|python_tag|>" in template:
        return "llama3_json"
    if "<tool_call>" in template:
        return "hermes"
    return None


def auto_reasoning_parser(facts: ModelFacts) -> str | None:
    """The thinking format the model writes (None: it does not think, or none known)."""
    template = facts.chat_template
    if facts.model_type == "gpt_oss":
        return "openai_gptoss"
    if "[THINK]" in template:
        return "mistral"
    if "<think>" not in template and "thinking" not in template:
        return None
    if "<arg_key>" in template or facts.model_type.startswith("glm4"):
        return "glm45"
    if "<|tool_calls_section_begin|>" in template or facts.model_type.startswith("kimi"):
        return "kimi_k2"
    if "｜Assistant｜" in template:
        return "deepseek_v3" if "thinking is defined" in template else "deepseek_r1"
    if "<think>" in template and "enable_thinking" in template:
        return "qwen3"
    return None


def choose_parsers(
    tool_call_parser: str | None, reasoning_parser: str | None, facts: ModelFacts
) -> ParserChoice:
    """The flags' values with `auto` resolved from the model (an explicit name kept), each
    decision logged once."""
    tool, reasoning = tool_call_parser, reasoning_parser
    if tool == AUTO:
        tool = _known(auto_tool_call_parser(facts), TOOL_CALL_PARSER_NAMES)
        _log_choice("tool-call", tool, facts)
    if reasoning == AUTO:
        reasoning = _known(auto_reasoning_parser(facts), REASONING_PARSER_NAMES)
        _log_choice("reasoning", reasoning, facts)
    return ParserChoice(tool, reasoning)


def resolved_parsers(frontend: FrontendConfig, tokenizer_info: Any) -> FrontendConfig:
    """The front end's options with `auto` parsers replaced by the model's (TokenizerInfo
    gives the config folder and the chat template)."""
    if AUTO not in (frontend.tool_call_parser, frontend.reasoning_parser):
        return frontend
    facts = read_model_facts(tokenizer_info.config_dir, tokenizer_info.chat_template_text)
    tool, reasoning = choose_parsers(frontend.tool_call_parser, frontend.reasoning_parser, facts)
    return msgspec.structs.replace(frontend, tool_call_parser=tool, reasoning_parser=reasoning)


def _known(name: str | None, names: tuple[str, ...]) -> str | None:
    return name if name in names else None


def _log_choice(kind: str, name: str | None, facts: ModelFacts) -> None:
    model = facts.model_type or "unknown model_type"
    if name is None:
        logger.info(
            "--%s-parser auto: no %s format known for this model (%s, its chat template); "
            "serving without one (name one with --%s-parser)",
            kind,
            kind,
            model,
            kind,
        )
    else:
        logger.info("--%s-parser auto: %s (from %s and its chat template)", kind, name, model)
