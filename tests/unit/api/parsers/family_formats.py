"""Reference outputs of each model family, as the family's own chat template (rendering an
assistant turn with tool_calls) or model card writes them, with the calls and reasoning a
parser must read out of them. The source of each is named beside it."""

from __future__ import annotations

from typing import Any, NamedTuple

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer"},
        "metric": {"type": "boolean"},
        "hours": {"type": "array", "items": {"type": "integer"}},
    },
    "required": ["city"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_SCHEMA}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
]


class ToolFormat(NamedTuple):
    parser: str
    text: str
    content: str | None
    calls: list[tuple[str, dict[str, Any]]]


TOOL_FORMATS = [
    # mistralai/Mistral-Small-3.2-24B-Instruct-2506 chat_template.jinja (tokenizer v11+):
    # "[TOOL_CALLS]" + name + "[ARGS]" + arguments|tojson, one marker per call.
    ToolFormat(
        "mistral",
        'Let me check.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 2}'
        "[TOOL_CALLS]get_time[ARGS]{}",
        "Let me check.",
        [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {})],
    ),
    # mistralai/Mistral-7B-Instruct-v0.3 tokenizer_config.json chat_template (v3):
    # "[TOOL_CALLS] [" + {"name": ..., "arguments": ...} ... + "]".
    ToolFormat(
        "mistral",
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]',
        None,
        [("get_weather", {"city": "Paris"})],
    ),
    # Qwen/Qwen3-Coder-30B-A3B-Instruct chat_template.jinja: <tool_call>\n<function=NAME>\n
    # <parameter=P>\nVALUE\n</parameter>\n ... </function>\n</tool_call>; values bare, typed by
    # the tool's schema.
    ToolFormat(
        "qwen3_coder",
        "I'll look it up.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n"
        "</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n"
        "</parameter>\n<parameter=hours>\n[1, 2]\n</parameter>\n</function>\n</tool_call>",
        "I'll look it up.\n",
        [("get_weather", {"city": "New York", "days": 3, "metric": True, "hours": [1, 2]})],
    ),
    # meta-llama/Llama-4-Scout-17B-16E-Instruct model card (pythonic tool calling) and its
    # chat template's <|python_start|> ... <|python_end|> wrapping.
    ToolFormat(
        "llama4_pythonic",
        '<|python_start|>[get_weather(city="San Francisco", days=2), get_time()]<|python_end|>',
        None,
        [("get_weather", {"city": "San Francisco", "days": 2}), ("get_time", {})],
    ),
    ToolFormat(
        "llama4_pythonic",
        '[get_weather(city="Rome")]',
        None,
        [("get_weather", {"city": "Rome"})],
    ),
    # deepseek-ai/DeepSeek-V3-0324 tokenizer_config.json chat_template: <｜tool▁call▁begin｜> +
    # type + <｜tool▁sep｜> + name + "\n```json\n" + arguments + "\n```" + <｜tool▁call▁end｜>.
    ToolFormat(
        "deepseek_v3",
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
        '{"city": "Tokyo"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>'
        "get_time\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        None,
        [("get_weather", {"city": "Tokyo"}), ("get_time", {})],
    ),
    # deepseek-ai/DeepSeek-V3.1 tokenizer_config.json chat_template: <｜tool▁call▁begin｜> + name
    # + <｜tool▁sep｜> + arguments + <｜tool▁call▁end｜>.
    ToolFormat(
        "deepseek_v31",
        "Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
        '{"city": "Tokyo", "days": 1}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        "Checking.",
        [("get_weather", {"city": "Tokyo", "days": 1})],
    ),
    # moonshotai/Kimi-K2-Instruct docs/tool_call_guidance.md: the section, functions.NAME:IDX,
    # then the arguments JSON.
    ToolFormat(
        "kimi_k2",
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        '<|tool_call_argument_begin|>{"city": "Beijing"}<|tool_call_end|>'
        "<|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>{}"
        "<|tool_call_end|><|tool_calls_section_end|>",
        None,
        [("get_weather", {"city": "Beijing"}), ("get_time", {})],
    ),
    # zai-org/GLM-4.5 chat_template.jinja: <tool_call>NAME\n<arg_key>K</arg_key>\n
    # <arg_value>V</arg_value>\n</tool_call>, strings bare, other values as JSON.
    ToolFormat(
        "glm45",
        "Sure.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Beijing</arg_value>"
        "\n<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>",
        "Sure.\n",
        [("get_weather", {"city": "Beijing", "days": 2})],
    ),
]

# Calls that must come back as content: cut off, malformed, or naming no offered function.
MALFORMED = [
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Par'),
    ("mistral", '[TOOL_CALLS]nope[ARGS]{"city": "Paris"}'),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n"),
    ("qwen3_coder", "<tool_call>\n<function=nope>\n</function>\n</tool_call>"),
    ("llama4_pythonic", '[get_weather(city="Rome"'),
    ("deepseek_v3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather"),
    ("deepseek_v31", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{x}"),
    ("kimi_k2", "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"),
    ("glm45", "<tool_call>nope\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n</tool_call>"),
    ("glm45", "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Bei"),
]


class ReasoningFormat(NamedTuple):
    parser: str
    template_kwargs: dict[str, Any]
    text: str
    reasoning: str | None
    content: str | None


REASONING_FORMATS = [
    # deepseek-ai/DeepSeek-V3.1 model card: thinking mode's prompt ends "<｜Assistant｜><think>"
    # and the reply closes it; non-thinking mode's prompt ends with "</think>".
    ReasoningFormat(
        "deepseek_v3", {"thinking": True}, "2+2 is 4.</think>It is 4.", "2+2 is 4.", "It is 4."
    ),
    ReasoningFormat("deepseek_v3", {}, "It is 4.", None, "It is 4."),
    # zai-org/GLM-4.5 chat_template.jinja: the model writes <think>...</think> after <|assistant|>.
    ReasoningFormat("glm45", {}, "<think>Add them.</think>\nIt is 4.", "Add them.", "It is 4."),
    ReasoningFormat("glm45", {"enable_thinking": False}, "It is 4.", None, "It is 4."),
    ReasoningFormat("glm45", {}, "It is 4.", None, "It is 4."),
    # moonshotai/Kimi-K2-Thinking chat template: <think>...</think>, then content or a section.
    ReasoningFormat("kimi_k2", {}, "<think>Look it up.</think>Sure.", "Look it up.", "Sure."),
    ReasoningFormat(
        "kimi_k2",
        {},
        "<think>Need the weather.<|tool_calls_section_begin|><|tool_call_begin|>",
        "Need the weather.",
        "<|tool_calls_section_begin|><|tool_call_begin|>",
    ),
    ReasoningFormat("kimi_k2", {"thinking": False}, "Sure.", None, "Sure."),
    # mistralai/Magistral-Small-2509 model card: [THINK]thoughts[/THINK]answer.
    ReasoningFormat(
        "mistral", {}, "[THINK]2+2=4[/THINK]The answer is 4.", "2+2=4", "The answer is 4."
    ),
    ReasoningFormat("mistral", {}, "The answer is 4.", None, "The answer is 4."),
]
