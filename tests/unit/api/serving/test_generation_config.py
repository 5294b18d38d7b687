"""--generation-config: request defaults from generation_config.json, the request's own win."""

from __future__ import annotations

import json

import pytest

from kvserve.services.api.serving.generation_config import load_generation_defaults


def _write(folder, **config) -> str:
    (folder / "generation_config.json").write_text(json.dumps(config))
    return str(folder)


def test_auto_takes_the_sampling_knobs_of_the_model_folder(tmp_path):
    model_dir = _write(
        tmp_path,
        temperature=0.6,
        top_p=0.9,
        top_k=20,
        min_p=0.05,
        repetition_penalty=1.1,
        max_new_tokens=64,
        eos_token_id=2,
        do_sample=True,
    )
    assert load_generation_defaults("auto", model_dir) == {
        "temperature": 0.6,
        "top_p": 0.9,
        "top_k": 20,
        "min_p": 0.05,
        "repetition_penalty": 1.1,
        "max_tokens": 64,
    }


def test_vllm_ignores_the_file_and_a_folder_replaces_the_models(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "other").mkdir()
    model_dir = _write(tmp_path / "model", temperature=0.6)
    other = _write(tmp_path / "other", top_k=5)
    assert load_generation_defaults("vllm", model_dir) == {}
    assert load_generation_defaults(other, model_dir) == {"top_k": 5}


def test_auto_without_a_file_is_no_defaults_but_a_named_folder_must_hold_one(tmp_path):
    assert load_generation_defaults("auto", str(tmp_path)) == {}
    with pytest.raises(ValueError, match="no generation_config.json"):
        load_generation_defaults(str(tmp_path), str(tmp_path))
