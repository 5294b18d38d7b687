"""Harmony (services/api/harmony/): the conversation rendered as gpt-oss's template renders
it, and the output split by channel, whole, streamed split anywhere (a hypothesis property),
and token by token through the real incremental detokenizer over a tokenizer that holds
harmony's special tokens; malformed calls come back as content."""

from __future__ import annotations

import json

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.services.api.harmony.output import HarmonyOutput
from kvserve.services.api.harmony.prompt import HarmonyPrompt, prefill_for
from kvserve.services.api.harmony.render import render_conversation
from kvserve.services.api.serving.detokenizer import make_detokenizer
from kvserve.services.api.serving.protocol import ChatCompletionRequest, ChatTool
from tests.support.chat_formats import HARMONY_TOKENS, write_byte_tokenizer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Gets the weather.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "The city"},
                "unit": {"type": "string", "enum": ["c", "f"], "default": "c"},
            },
            "required": ["city"],
        },
    },
}
TOOLS = msgspec.convert([WEATHER], list[ChatTool])

# The harmony response format guide (cookbook.openai.com/articles/openai-harmony), its
# function-calling example, and a final answer after thinking.
CALL_OUTPUT = (
    '<|channel|>analysis<|message|>User asks: "What is the weather in Tokyo?" We need to use '
    "get_weather.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather "
    '<|constrain|>json<|message|>{"city":"Tokyo"}<|call|>'
)
FINAL_OUTPUT = (
    "<|channel|>analysis<|message|>User asks a simple question: 2 + 2.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>2 + 2 = 4.<|return|>"
)
CASES = [
    (CALL_OUTPUT, ('User asks: "What is the weather in Tokyo?" We need to use get_weather.',
                   None, [("get_weather", {"city": "Tokyo"})])),
    (FINAL_OUTPUT, ("User asks a simple question: 2 + 2.", "2 + 2 = 4.", [])),
    # A commentary preamble is content; the call after it a call.
    ("<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>commentary"
     ' to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}<|call|>',
     (None, "Checking.", [("get_weather", {"city": "Oslo"})])),
    # Cut off mid-thought (finish_reason length): all reasoning so far.
    ("<|channel|>analysis<|message|>Still thinking", ("Still thinking", None, [])),
    # A model that ignored the format: its text is content.
    ("plain words", (None, "plain words", [])),
]  # fmt: skip
MALFORMED = [
    # truncated JSON, the call never closed
    '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Tok',
    # a function the request did not offer
    "<|channel|>commentary to=functions.nope <|constrain|>json<|message|>{}<|call|>",
    # arguments that are not a JSON object
    "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>[1]<|call|>",
]


def summary(reasoning, content, calls):
    return reasoning, content, [(c.function.name, json.loads(c.function.arguments)) for c in calls]


def streamed(pieces: list[str], choice: str = "auto"):
    output = HarmonyOutput(choice, TOOLS)
    reasoning, content, calls = "", "", {}
    for number, piece in enumerate(pieces):
        r, c, deltas = output.update(piece, finished=number == len(pieces) - 1)
        reasoning, content = reasoning + r, content + (c or "")
        for delta in deltas:
            calls[delta.index] = (delta.function.name, json.loads(delta.function.arguments))
    return reasoning or None, content or None, list(calls.values())


@pytest.mark.parametrize("text, expected", CASES)
def test_channels_parse_whole_and_char_by_char(text, expected):
    assert summary(*HarmonyOutput("auto", TOOLS).result(text)) == expected
    assert streamed(list(text)) == expected


@pytest.mark.parametrize("text, expected", CASES)
@settings(max_examples=60, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=12))
def test_channels_stream_split_anywhere(text, expected, cuts):
    bounds = [0, *sorted(c % (len(text) + 1) for c in cuts), len(text)]
    assert streamed([text[a:b] for a, b in zip(bounds, bounds[1:])]) == expected


@pytest.mark.parametrize("text", MALFORMED)
def test_malformed_calls_are_content(text):
    reasoning, content, calls = HarmonyOutput("auto", TOOLS).result(text)
    assert calls == [] and content and content.strip().startswith(("{", "["))
    assert streamed(list(text))[2] == []


def test_tool_choice_none_makes_calls_content_and_finish_reason_follows_calls():
    _, content, calls = HarmonyOutput("none", TOOLS).result(CALL_OUTPUT)
    assert calls == [] and content == '{"city":"Tokyo"}'
    output = HarmonyOutput("auto", TOOLS)
    _, _, calls = output.result(CALL_OUTPUT)
    assert output.finish_reason("stop", len(calls)) == "tool_calls"
    assert output.finish_reason("length", 0) == "length"


def test_the_conversation_renders_as_harmony_with_its_history_rules():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Sunny.", "reasoning": "old thought"},
        {"role": "user", "content": "And Tokyo?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning": "need the tool",
            "tool_calls": [
                {"id": "c1", "function": {"name": "get_weather", "arguments": {"city": "Tokyo"}}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 20}'},
    ]
    text = render_conversation(messages, [WEATHER], "high")
    assert text.startswith("<|start|>system<|message|>You are ChatGPT")
    assert "Reasoning: high" in text
    assert "Calls to these tools must go to the commentary channel: 'functions'." in text
    assert (
        "<|start|>developer<|message|># Instructions\n\nBe brief.\n\n# Tools\n\n## functions\n\n"
        "namespace functions {\n\n// Gets the weather.\ntype get_weather = (_: {\n"
        '// The city\ncity: string,\nunit?: "c" | "f", // default: c\n}) => any;\n\n'
        "} // namespace functions<|end|>"
    ) in text
    # The chain of thought before a final answer is dropped; the one of the turn still
    # calling tools is kept.
    assert "old thought" not in text
    assert "<|start|>assistant<|channel|>final<|message|>Sunny.<|end|>" in text
    assert text.endswith(
        "<|start|>assistant<|channel|>analysis<|message|>need the tool<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"city": "Tokyo"}<|call|>'
        "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"
        '{"temp": 20}<|end|><|start|>assistant'
    )
    with pytest.raises(ValueError, match="reasoning_effort"):
        render_conversation(messages, None, "extreme")


def test_prefills_of_constrained_tool_choices():
    assert prefill_for("auto") == prefill_for("none") == ""
    assert prefill_for("required") == "<|channel|>commentary<|message|>"
    assert prefill_for("get_weather") == (
        "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
    )


@pytest.fixture(scope="module")
def harmony_tokenizer(tmp_path_factory):
    from transformers import PreTrainedTokenizerFast

    model_dir = str(tmp_path_factory.mktemp("harmony-tokenizer"))
    write_byte_tokenizer(model_dir, HARMONY_TOKENS, "<|return|>")
    return PreTrainedTokenizerFast.from_pretrained(model_dir)


def test_prompts_tokenize_with_one_id_per_special_token(harmony_tokenizer):
    prompt = HarmonyPrompt(harmony_tokenizer)
    ids = {t: harmony_tokenizer.convert_tokens_to_ids(t) for t in HARMONY_TOKENS}
    assert prompt.stop_token_ids == [ids["<|return|>"], ids["<|call|>"]]
    assert (
        prompt.final_header_ids[0] == ids["<|channel|>"]
        and prompt.final_header_ids[-1] == (ids["<|message|>"])
    )
    request = msgspec.convert(
        {"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER]},
        ChatCompletionRequest,
    )
    token_ids = prompt.token_ids(request, [{"role": "user", "content": "hi"}], "get_weather")
    assert token_ids[-1] == ids["<|message|>"] and token_ids.count(ids["<|start|>"]) == 4


@pytest.mark.parametrize("text, expected", CASES[:3])
def test_outputs_parse_token_by_token_through_the_detokenizer(harmony_tokenizer, text, expected):
    token_ids = harmony_tokenizer.encode(text, add_special_tokens=False)
    detokenizer = make_detokenizer(harmony_tokenizer, [], False)
    pieces = []
    for token_id in token_ids:
        pieces.append(detokenizer.update([token_id]))
    assert "".join(pieces) == text
    assert streamed(pieces) == expected
