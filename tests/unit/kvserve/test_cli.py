"""`kvserve` flags as a vLLM user types them: each parses into the typed options it must set,
and each vLLM flag kvserve cannot honour is refused by name (never silently ignored)."""

from __future__ import annotations

import pytest

from kvserve.cli import config_file_argv, parse_options
from kvserve.shared.launch_options import ServeOptions


def _serve(*argv: str) -> ServeOptions:
    command, options = parse_options(["serve", *argv])
    assert command == "serve"
    return options


# (argv, where the value lands, expected value)
CASES = [
    (["--model", "m"], lambda o: o.engine.model.model, "m"),
    (["m"], lambda o: o.engine.model.model, "m"),
    (["-tp", "2"], lambda o: o.engine.parallel.tensor_parallel_size, 2),
    (["-pp", "2"], lambda o: o.engine.parallel.pipeline_parallel_size, 2),
    (["-dp", "2"], lambda o: o.engine.parallel.data_parallel_size, 2),
    (["--dtype", "half"], lambda o: o.engine.model.dtype_name, "float16"),
    (["--dtype", "float"], lambda o: o.engine.model.dtype_name, "float32"),
    (["--dtype", "float16"], lambda o: o.engine.model.dtype_name, "float16"),
    (["--dtype", "bfloat16"], lambda o: o.engine.model.dtype_name, "bfloat16"),
    (["--dtype", "auto"], lambda o: o.engine.model.dtype_name, "auto"),
    (["--max-model-len", "32k"], lambda o: o.engine.model.max_model_len, 32000),
    (["--max-model-len", "32K"], lambda o: o.engine.model.max_model_len, 32768),
    (["--max-model-len", "4096"], lambda o: o.engine.model.max_model_len, 4096),
    (["--kv-cache-memory-bytes", "2G"], lambda o: o.engine.cache.kv_cache_memory_bytes, 2 << 30),
    (["--kv-cache-memory", "512M"], lambda o: o.engine.cache.kv_cache_memory_bytes, 512 << 20),
    (["--max-logprobs", "5"], lambda o: o.engine.model.max_logprobs, 5),
    (["--enforce-eager"], lambda o: o.engine.model.enforce_eager, True),
    (["--cuda-graph-sizes", "1", "2", "4"], lambda o: o.engine.model.cuda_graph_sizes, [1, 2, 4]),
    (["--cuda-graph-sizes"], lambda o: o.engine.model.cuda_graph_sizes, []),
    (["--trust-remote-code"], lambda o: o.engine.model.trust_remote_code, True),
    (["--disable-custom-all-reduce"], lambda o: o.engine.parallel.disable_custom_all_reduce, True),
    (["--chat-template", "{{ messages }}"], lambda o: o.frontend.chat_template, "{{ messages }}"),
    (["--generation-config", "vllm"], lambda o: o.frontend.generation_config, "vllm"),
    (["--enable-log-requests"], lambda o: o.frontend.enable_log_requests, True),
    (["--max-log-len", "100"], lambda o: o.frontend.max_log_len, 100),
    (["--disable-log-stats"], lambda o: o.frontend.disable_log_stats, True),
    (["--enable-prompt-tokens-details"], lambda o: o.frontend.enable_prompt_tokens_details, True),
    (["--return-tokens-as-token-ids"], lambda o: o.frontend.return_tokens_as_token_ids, True),
    (["--enable-request-id-headers"], lambda o: o.frontend.enable_request_id_headers, True),
    (
        ["--allowed-origins", '["https://a.example"]'],
        lambda o: o.http.allowed_origins,
        ["https://a.example"],
    ),
    (["--allow-credentials"], lambda o: o.http.allow_credentials, True),
    (["--allowed-methods", '["GET", "POST"]'], lambda o: o.http.allowed_methods, ["GET", "POST"]),
    (["--allowed-headers", '["x-a"]'], lambda o: o.http.allowed_headers, ["x-a"]),
    (
        ["--ssl-keyfile", "k.pem", "--ssl-certfile", "c.pem"],
        lambda o: (o.http.ssl_keyfile, o.http.ssl_certfile),
        ("k.pem", "c.pem"),
    ),
    (["--root-path", "/llm"], lambda o: o.http.root_path, "/llm"),
    (["--executor", "mp"], lambda o: o.engine.parallel.distributed_executor_backend, "mp"),
    (["--kv-cache-dtype", "auto"], lambda o: o.engine.cache, ServeOptions().engine.cache),
    (["--kv-cache-dtype", "fp8"], lambda o: o.engine.cache.cache_dtype, "fp8"),
    (["--load-format", "safetensors"], lambda o: o.engine, ServeOptions().engine),
    (
        ["--structured-outputs-config", '{"backend": "xgrammar", "disable_any_whitespace": true}'],
        lambda o: (
            o.engine.structured_outputs_config.backend,
            o.engine.structured_outputs_config.disable_any_whitespace,
        ),
        ("xgrammar", True),
    ),
    (["--guided-decoding-backend", "xgrammar"], lambda o: o.engine, ServeOptions().engine),
    (
        ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"],
        lambda o: (o.frontend.enable_auto_tool_choice, o.frontend.tool_call_parser),
        (True, "hermes"),
    ),
    (
        [
            "--speculative-config",
            '{"method": "eagle3", "model": "/d", "num_speculative_tokens": 3}',
        ],
        lambda o: (
            o.engine.speculative_config.method,
            o.engine.speculative_config.model,
            o.engine.speculative_config.uses_lookahead_slots,
        ),
        ("eagle3", "/d", True),
    ),
    (["--tool-call-parser", "llama3_json"], lambda o: o.frontend.tool_call_parser, "llama3_json"),
    (["--tool-call-parser", "pythonic"], lambda o: o.frontend.tool_call_parser, "pythonic"),
    (
        ["--exclude-tools-when-tool-choice-none"],
        lambda o: o.frontend.exclude_tools_when_tool_choice_none,
        True,
    ),
]


@pytest.mark.parametrize("argv, where, expected", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_flag_lands_in_its_option(argv, where, expected):
    assert where(_serve(*argv)) == expected


def test_defaults_are_vllms():
    options = _serve()
    assert options.http.allowed_origins == ["*"] and options.http.allowed_methods == ["*"]
    assert options.frontend.generation_config == "auto"
    assert options.engine.model.max_logprobs == 20


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--quantization", "bitsandbytes"], "invalid choice: 'bitsandbytes'"),
        (["-q", "marlin"], "invalid choice: 'marlin'"),
        (["--lora-modules", "a=/x"], "--lora-modules needs --enable-lora"),
        (["--enable-lora", "--lora-modules", "a"], "give name=path or a JSON object"),
        (["--enable-lora", "--max-loras", "0"], "max_loras must be >= 1"),
        (["--speculative-config", '{"method": "ngram"}'], "missing required field"),
        (["--speculative-config", '{"method": "x", "num_speculative_tokens": 2}'], "`$.method`"),
        (
            ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2, "k": 1}'],
            "unknown field `k`",
        ),
        (
            ["--speculative-config", '{"method": "medusa", "num_speculative_tokens": 2}'],
            "medusa needs `model`",
        ),
        (
            ["--speculative-config", '{"method": "eagle3", "num_speculative_tokens": 2}'],
            "eagle3 needs `model`",
        ),
        (["--kv-cache-dtype", "fp4"], "invalid choice: 'fp4'"),
        (["--revision", "main"], "no downloads"),
        (["--dtype", "int8"], "invalid choice: 'int8'"),
        (["--ssl-keyfile", "k.pem"], "TLS needs both --ssl-keyfile and --ssl-certfile"),
        (["--max-logprobs", "-1"], "max_logprobs must be >= 0"),
        (["a", "--model", "b"], "model given twice"),
        (["--tool-call-parser", "granite"], "invalid choice: 'granite'"),
        (
            ["--structured-outputs-config", '{"backend": "outlines"}'],
            "backend 'outlines' is not supported",
        ),
        (
            ["--structured-outputs-config", '{"reasoning_parser": "granite"}'],
            "reasoning_parser 'granite' is not one of deepseek_r1, qwen3, deepseek_v3",
        ),
        (
            ["--guided-decoding-backend", "outlines"],
            "--guided-decoding-backend outlines: not supported by kvserve",
        ),
        (["--reasoning-parser", "granite"], "invalid choice: 'granite'"),
    ],
)
def test_unsupported_and_invalid_flags_are_refused_by_name(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_options(["serve", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_the_reasoning_parser_and_the_runner_reach_the_front_end():
    options = _serve("--reasoning-parser", "qwen3", "--runner", "pooling")
    assert options.frontend.reasoning_parser == "qwen3" and options.frontend.runner == "pooling"
    # auto (the default) is resolved against the model when the api starts.
    assert _serve().frontend.reasoning_parser == "auto"
    assert _serve().frontend.tool_call_parser == "auto"


def test_config_file_flags_and_command_line_precedence(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text(
        "model: /models/a\nmax_num_seqs: 8\nenable-prefix-caching: false\n"
        'allowed-origins: ["https://a.example"]\nport: 9001\n-tp: 1\n'
    )
    options = _serve("--config", str(path), "--port", "9002")
    assert options.engine.model.model == "/models/a"
    assert options.engine.scheduler.max_num_seqs == 8
    assert options.engine.cache.enable_prefix_caching is False
    assert options.http.allowed_origins == ["https://a.example"]
    assert options.http.port == 9002  # the command line wins
    assert _serve("/models/b", "--config", str(path)).engine.model.model == "/models/b"


def test_config_file_errors_name_the_file(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("- just\n- a list\n")
    with pytest.raises(SystemExit):
        parse_options(["serve", "--config", str(bad)])
    assert "expected a mapping" in capsys.readouterr().err
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("no-such-flag: 1\n")
    with pytest.raises(SystemExit):
        parse_options(["serve", "--config", str(unknown)])
    assert "--no-such-flag" in capsys.readouterr().err


def test_config_file_argv_spells_values_as_flags(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("a_b: 1\nc: true\nd: false\ne: [1, 2]\nf: null\n")
    assert config_file_argv(str(path)) == ["--a-b", "1", "--c", "--no-d", "--e", "[1, 2]"]


@pytest.mark.parametrize("command", ["api", "engine", "generate"])
def test_every_engine_facing_command_refuses_the_same_flags(command, capsys):
    required = {
        "api": ["--input-addr", "a", "--output-addr", "b"],
        "engine": ["--input-addr", "a", "--output-addr", "b"],
        "generate": ["--prompt", "p"],
    }[command]
    with pytest.raises(SystemExit):
        parse_options([command, *required, "--cpu-offload-gb", "1"])
    assert "not supported by kvserve" in capsys.readouterr().err
