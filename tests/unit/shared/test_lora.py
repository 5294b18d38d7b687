"""LoRA pieces every process shares: --lora-modules entries, adapter configs, the hash key."""

from __future__ import annotations

import json

import pytest

from kvserve.cli import parse_options
from kvserve.shared.hashing import get_hash_fn, hash_new_full_blocks, make_extra_keys
from kvserve.shared.lora import LoRAModulePath, LoRARequest, lora_extra_key, read_adapter_config


def write_adapter(folder, weights: bool = True, **config) -> str:
    folder.mkdir()
    base = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}
    (folder / "adapter_config.json").write_text(json.dumps(base | config))
    if weights:
        (folder / "adapter_model.safetensors").write_bytes(b"")
    return str(folder)


def test_lora_modules_flag_takes_both_forms():
    _, options = parse_options(
        [
            "serve",
            "--enable-lora",
            "--max-loras",
            "4",
            "--lora-modules",
            "sql=/a/sql",
            '{"name": "chat", "path": "/a/chat", "base_model_name": "base"}',
        ]
    )
    assert options.frontend.lora_modules == [
        LoRAModulePath(name="sql", path="/a/sql"),
        LoRAModulePath(name="chat", path="/a/chat", base_model_name="base"),
    ]
    assert (options.engine.lora.enable_lora, options.engine.lora.max_loras) == (True, 4)
    assert options.engine.lora.cpu_cache_size == 4  # max_cpu_loras defaults to max_loras


def test_adapter_config_scaling_and_targets(tmp_path):
    config = read_adapter_config(
        write_adapter(tmp_path / "a", target_modules=["model.layers.0.self_attn.q_proj", "v_proj"])
    )
    assert config.target_modules == ("q_proj", "v_proj")
    assert config.scaling == 2.0
    rs = read_adapter_config(write_adapter(tmp_path / "rs", r=16, lora_alpha=8, use_rslora=True))
    assert rs.scaling == 2.0  # 8 / sqrt(16)


@pytest.mark.parametrize(
    "config, weights, message",
    [
        ({"use_dora": True}, True, "does not support LoRA use_dora"),
        ({"modules_to_save": ["lm_head"]}, True, "modules_to_save"),
        ({"target_modules": ["lm_head"]}, True, "must be among"),
        ({"target_modules": ".*proj"}, True, "not a regex"),
        ({"r": 32}, True, "rank 32, more than --max-lora-rank 16"),
        ({}, False, "lacks adapter_model.safetensors"),
    ],
)
def test_adapters_kvserve_cannot_run_are_refused(tmp_path, config, weights, message):
    with pytest.raises(ValueError, match=message):
        read_adapter_config(write_adapter(tmp_path / "x", weights, **config), max_lora_rank=16)


def test_block_hashes_differ_per_adapter_and_match_for_the_same():
    hash_fn = get_hash_fn("sha256")
    tokens = list(range(40))

    def chain(lora, salt=None):
        extra = make_extra_keys(salt, lora_extra_key(lora))
        return hash_new_full_blocks(hash_fn, 16, tokens, [], extra)

    a, b = LoRARequest("a", 1, "/a"), LoRARequest("b", 2, "/b")
    assert chain(a) == chain(LoRARequest("a", 1, "/a"))
    assert len({chain(a)[0], chain(b)[0], chain(None)[0], chain(a, "s")[0]}) == 4
    assert make_extra_keys(None, lora_extra_key(None)) is None  # base model: no extra key
    assert make_extra_keys("s") == b"salt\x00s"  # the salt's key is what it always was
