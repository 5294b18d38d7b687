"""PlainTokenizer (no transformers import) against transformers' tokenizer of the same folder:
the same ids, text, special tokens and rendered chat templates, on the default model and the
tiny test model; folders it does not cover go to transformers."""

from __future__ import annotations

import json
import os
import shutil

import jinja2
import pytest
from transformers import PreTrainedTokenizerFast

from kvserve.services.api.serving.plain_tokenizer import PlainTokenizer, load_plain_tokenizer
from kvserve.services.api.serving.tokenizer import TokenizerInfo

TEXTS = [
    "Hello, world!",
    "  leading spaces and\ttabs\nnew lines\n\n",
    "héllo wörld — 日本語 😀🎉 🦀",
    "<|im_start|>user\nHi<|im_end|>\n<|endoftext|> inline specials",
    "",
]
# A template that uses what transformers' environment adds: tojson with options, namespace,
# loop controls, the special tokens as variables, tools and extra variables.
TEMPLATE = (
    "{{ bos_token or '' }}{% set ns = namespace(count=0) %}"
    "{% if tools %}Tools: {{ tools | tojson(indent=2) }}\n{% endif %}"
    "{% for m in messages %}{% if m.role == 'skip' %}{% continue %}{% endif %}"
    "{% set ns.count = ns.count + 1 %}"
    "{{ m.role }}{% if m.content is defined %}: {{ m.content }}{% endif %}"
    "{% if m.reasoning_content %} [thinking: {{ m.thinking }}]{% endif %}"
    "{% if m.tool_calls %} calls {{ m.tool_calls | tojson }}{% endif %}\n"
    "{% endfor %}{{ ns.count }} messages{{ eos_token }}"
    "{% if enable_thinking is defined %} thinking={{ enable_thinking }}{% endif %}"
    "{% if add_generation_prompt %}\nassistant: {% endif %}"
)
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "greet back"},
        {"role": "skip", "content": "never shown"},
        {"role": "user", "content": 'Ünïcödé 😀, "quotes" <b>html</b>', "name": None},
    ],
    [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"type": "function", "function": {"name": "w", "arguments": "{}"}}],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "1"},
    ],
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "weather",
            "description": "Weather <here> & now",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="module", params=["default", "tiny"])
def folder(request) -> str:
    name = "default_model_dir" if request.param == "default" else "tiny_llama_dir"
    return request.getfixturevalue(name)


def _pair(folder: str, template: str | None = None):
    plain = load_plain_tokenizer(folder, template)
    assert isinstance(plain, PlainTokenizer), folder
    hf = PreTrainedTokenizerFast.from_pretrained(folder)
    if template is not None:
        hf.chat_template = template
    return plain, hf


def test_ids_text_and_special_tokens_equal_transformers(folder):
    plain, hf = _pair(folder)
    for text in TEXTS:
        for add_special_tokens in (True, False):
            ids = hf.encode(text, add_special_tokens=add_special_tokens)
            assert plain.encode(text, add_special_tokens=add_special_tokens) == ids, text
        ids = hf.encode(text)
        for skip in (True, False):
            assert plain.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip), text
            tokens = hf.convert_ids_to_tokens(ids, skip_special_tokens=skip)
            assert plain.convert_ids_to_tokens(ids, skip_special_tokens=skip) == tokens
            assert plain.convert_tokens_to_string(tokens) == hf.convert_tokens_to_string(tokens)
            assert plain.convert_tokens_to_ids(tokens) == hf.convert_tokens_to_ids(tokens)
        for token_id in ids:
            assert plain.decode(token_id) == hf.decode(token_id)
            assert plain.convert_ids_to_tokens(token_id) == hf.convert_ids_to_tokens(token_id)
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        assert getattr(plain, name) == getattr(hf, name), name
        assert getattr(plain, f"{name}_id") == getattr(hf, f"{name}_id"), name
    assert set(plain.all_special_tokens) == set(hf.all_special_tokens)
    assert set(plain.all_special_ids) == set(hf.all_special_ids)
    assert len(plain) == len(hf) and plain.get_vocab() == hf.get_vocab()
    assert plain.convert_tokens_to_ids("no-such-token-here") == hf.convert_tokens_to_ids(
        "no-such-token-here"
    )
    assert plain._transformers is None  # nothing above needed transformers


@pytest.mark.parametrize("own_template", [False, True], ids=["folder", "given"])
def test_chat_templates_render_as_transformers_renders_them(folder, own_template):
    plain, hf = _pair(folder, TEMPLATE if own_template else None)
    if plain.chat_template is None:
        pytest.skip("the folder has no chat template")
    num_rendered = 0
    for messages in CONVERSATIONS:
        for add_generation_prompt in (True, False):
            for extra in ({}, {"tools": TOOLS}, {"enable_thinking": False}):
                kwargs = {"add_generation_prompt": add_generation_prompt, **extra}
                text = _outcome(hf.apply_chat_template, messages, tokenize=False, **kwargs)
                assert _outcome(plain.apply_chat_template, messages, tokenize=False, **kwargs) == (
                    text
                )
                ids = _outcome(hf.apply_chat_template, messages, return_dict=False, **kwargs)
                assert _outcome(plain.apply_chat_template, messages, **kwargs) == ids
                num_rendered += text[0] == "ok"
    assert num_rendered >= 6  # the folder's template fails where a message lacks content
    assert plain._transformers is None


def _outcome(fn, *args, **kwargs) -> tuple:
    """("ok", the result as a list or text) or ("error", the exception's type and text)."""
    try:
        result = fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - both must fail alike
        return ("error", type(exc).__name__, str(exc))
    return ("ok", result if isinstance(result, str) else list(result))


def test_what_it_does_not_render_or_compute_comes_from_transformers(tiny_llama_dir):
    plain, hf = _pair(tiny_llama_dir, TEMPLATE)
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}]
    ids = plain.apply_chat_template(messages, continue_final_message=True, return_dict=False)
    assert ids == hf.apply_chat_template(messages, continue_final_message=True, return_dict=False)
    assert plain("ab", "cd")["input_ids"] == hf("ab", "cd")["input_ids"]  # a pair encoding
    assert plain.name_or_path == hf.name_or_path
    assert plain._transformers is not None


def test_folders_it_does_not_cover_load_transformers_tokenizer(tiny_llama_dir, tmp_path):
    raising = load_plain_tokenizer(tiny_llama_dir, "{{ raise_exception('raised') }}")
    assert raising is not None
    with pytest.raises(jinja2.TemplateError, match="raised"):
        raising.apply_chat_template([{"role": "user", "content": "x"}])
    assert load_plain_tokenizer(tiny_llama_dir, "{% generation %}x{% endgeneration %}") is None
    changed = str(tmp_path / "changed")
    shutil.copytree(tiny_llama_dir, changed)
    config_path = os.path.join(changed, "tokenizer_config.json")
    with open(config_path) as f:
        config = json.load(f)
    for key, value in (("add_bos_token", True), ("clean_up_tokenization_spaces", True)):
        with open(config_path, "w") as f:
            json.dump({**config, key: value}, f)
        assert load_plain_tokenizer(changed, None) is None, key
        info = TokenizerInfo(changed, plain=True)
        assert isinstance(info.tokenizer, PreTrainedTokenizerFast), key
    assert isinstance(TokenizerInfo(tiny_llama_dir, plain=True).tokenizer, PlainTokenizer)
    assert isinstance(TokenizerInfo(tiny_llama_dir).tokenizer, PreTrainedTokenizerFast)
