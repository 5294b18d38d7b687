"""Flags generated from the typed option structs (shared/cli_args.py, shared/config.py)."""

from __future__ import annotations

import argparse
from typing import Annotated, Literal

import msgspec
import pytest

from kvserve.shared.cli_args import add_struct_args, flag_names, parse_size, struct_from_args
from kvserve.shared.config import EngineConfig
from kvserve.shared.launch_options import ServeOptions, WorkerOptions
from kvserve.shared.shm_ring import ShmRingHandle


def _parse(struct_type, argv, **kwargs):
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_struct_args(parser, struct_type, **kwargs)
    return struct_from_args(struct_type, parser.parse_args(argv))


def test_defaults_stay_the_structs_own():
    assert _parse(ServeOptions, [], positional=("model",)) == ServeOptions()


def test_flags_reach_the_nested_struct_that_owns_them():
    options = _parse(
        ServeOptions,
        [
            "m.gguf",
            "--executor",
            "mp",
            "--kv-cache-memory",
            "1G",
            "--no-enable-prefix-caching",
            "--port",
            "9000",
            "--dp-routing",
            "prefix",
            "--data-parallel-size",
            "2",
        ],
        positional=("model",),
    )
    assert options.engine.model.model == "m.gguf"
    assert options.engine.parallel.distributed_executor_backend == "mp"
    assert options.engine.cache.kv_cache_memory_bytes == 1 << 30
    assert options.engine.cache.enable_prefix_caching is False
    assert options.engine.parallel.data_parallel_size == 2
    assert options.http.port == 9000
    assert options.data_parallel.dp_routing == "prefix"


def test_model_as_positional_or_flag_but_not_two_different_ones():
    assert _parse(EngineConfig, ["--model", "x"], positional=("model",)).model.model == "x"
    assert _parse(EngineConfig, ["x", "--model", "x"], positional=("model",)).model.model == "x"
    with pytest.raises(ValueError, match="model given twice"):
        _parse(EngineConfig, ["x", "--model", "y"], positional=("model",))


def test_choices_and_struct_validation_are_enforced():
    with pytest.raises(argparse.ArgumentError):
        _parse(EngineConfig, ["--dtype", "int3"])
    with pytest.raises(ValueError, match="power of two"):
        _parse(EngineConfig, ["--block-size", "3"])
    with pytest.raises(ValueError, match="data-parallel-start-rank"):
        _parse(ServeOptions, ["--data-parallel-start-rank", "1"])


def test_required_fields_are_required_flags_and_json_fields_decode():
    handle = ShmRingHandle(name="ring", num_readers=2, num_chunks=4, chunk_bytes=64)
    config = EngineConfig.from_kwargs(max_num_seqs=3)
    argv = [
        "--rank",
        "1",
        "--model-dir",
        "/m",
        "--result-addr",
        "ipc://x",
        "--engine-config",
        msgspec.json.encode(config).decode(),
        "--ring-handle",
        msgspec.json.encode(handle).decode(),
    ]
    options = _parse(WorkerOptions, argv)
    assert options.engine_config == config and options.ring_handle == handle
    with pytest.raises(SystemExit):  # argparse: "the following arguments are required: --rank"
        _parse(WorkerOptions, argv[2:])


class _A(msgspec.Struct, kw_only=True):
    port: int = 1


class _B(msgspec.Struct, kw_only=True):
    port: Annotated[Literal[1, 2], msgspec.Meta(description="again")] = 1


class _Both(msgspec.Struct, kw_only=True):
    a: _A = msgspec.field(default_factory=_A)
    b: _B = msgspec.field(default_factory=_B)


def test_a_flag_defined_twice_in_one_tree_is_refused():
    with pytest.raises(AssertionError, match="--port defined twice"):
        add_struct_args(argparse.ArgumentParser(), _Both)


def test_flag_names_cover_every_engine_area():
    names = flag_names(EngineConfig)
    assert {"model", "block_size", "max_num_seqs", "tensor_parallel_size"} <= names
    assert "cache" not in names


@pytest.mark.parametrize(
    "text, expected",
    [("4096", 4096), ("4G", 4 << 30), ("4GiB", 4 << 30), ("512M", 512 << 20), ("1.5k", 1536)],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


def test_engine_config_from_kwargs_names_unknown_arguments():
    config = EngineConfig.from_kwargs(model="m", block_size=32, max_num_seqs=4)
    assert (config.model.model, config.cache.block_size, config.scheduler.max_num_seqs) == (
        "m",
        32,
        4,
    )
    with pytest.raises(ValueError, match="unknown engine argument 'max_num_sequences'"):
        EngineConfig.from_kwargs(max_num_sequences=4)
