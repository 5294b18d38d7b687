"""4-bit checkpoints held quantized (AWQ, GPTQ, compressed-tensors W4A16): each tiny fixture
in tests/data/int4 (made by the real tools: tests/support/make_int4_fixtures.py) loaded by
kvserve and compared with the tool's own dequantization (bit for bit), with HF transformers
running that dequantized float model, across tensor parallelism, and the refusals."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kvserve.kernels import int4
from kvserve.kernels.quant import QuantizedTensor, quant_linear
from kvserve.services.worker.models import iterate_safetensors, load_model
from kvserve.services.worker.quant_formats.int4 import held_weights, pack_w4
from kvserve.services.worker.quantization import (
    checkpoint_qconfig,
    checkpoint_quantization,
    resolve_quantization,
    weight_bytes,
)
from tests.support.model_steps import (
    ATOL,
    assert_tensor_parallel_2_matches_hf,
    bind_kv_caches,
    hf_logits,
    random_tokens,
    run_step,
)

FIXTURES = Path(__file__).resolve().parents[2] / "data" / "int4"
NAMES = (
    "ct_w4a16_g128",  # llm-compressor GPTQModifier W4A16: sym, group 128
    "ct_w4a16_asym_g32",  # llm-compressor AWQModifier: asym (packed zero points), group 32
    "ct_w4a16_channel",  # llm-compressor GPTQModifier: per channel, actorder weight
    "ct_w4a16_actorder",  # compressed-tensors' compressor: group 32 with weight_g_idx
    "awq_g32",  # AWQ GEMM layout (read back equal by AutoAWQ)
    "gptq_g32_act",  # GPTQ asym group 32, desc_act (read back equal by GPTQModel)
)
METHODS = {"ct": "compressed-tensors", "awq": "awq", "gptq": "gptq"}
VOCAB = 128


def _folder(name: str) -> str:
    return str(FIXTURES / name)


def _held(name: str) -> dict[str, QuantizedTensor]:
    folder = _folder(name)
    method = checkpoint_quantization(folder)
    assert method == METHODS[name.split("_")[0]]
    stream = held_weights(method, checkpoint_qconfig(folder), iterate_safetensors(folder))
    return {n: t for n, t in stream if isinstance(t, QuantizedTensor)}


@pytest.mark.parametrize("name", NAMES)
def test_held_weight_dequantizes_to_the_tools_own_bit_for_bit(name):
    reference = load_file(f"{_folder(name)}/reference/dequantized.safetensors")
    held = _held(name)
    assert set(held) == set(reference)
    for key, expected in reference.items():
        qt = held[key]
        assert qt.shape == tuple(expected.shape)
        assert torch.equal(qt.dequantize(), expected), key  # the C kernel's expansion
        torch_ref = int4.unpermute(int4.dequantize_ref(qt), qt.perm)
        assert torch.equal(torch_ref, expected), key
    act_order = name.endswith("act") or name.endswith("actorder")
    assert all((qt.perm is not None) == act_order for qt in held.values())


@pytest.fixture(scope="module")
def hf_dequantized():
    """name -> HF transformers' LlamaForCausalLM on the tool's dequantized weights (float32)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cache = {}

    def get(name: str):
        if name not in cache:
            folder = _folder(name)
            with open(f"{folder}/config.json") as f:
                fields = json.load(f)
            fields.pop("quantization_config")
            config = LlamaConfig(**fields)
            config._attn_implementation = "eager"
            model = LlamaForCausalLM(config).eval().float()
            names = set(model.state_dict())  # the float tensors; the packed ones are not
            state = {n: t.float() for n, t in iterate_safetensors(folder) if n in names}
            state.update(load_file(f"{folder}/reference/dequantized.safetensors"))
            model.load_state_dict(state, strict=True)
            cache[name] = model
        return cache[name]

    return get


def _ours(folder: str, quantization: str | None = None):
    model, _ = load_model(folder, torch.float32, "cpu", quantization)
    bind_kv_caches(model, num_blocks=16)
    return model


def _prefill_chunk_decodes(model, tokens: list[int]) -> torch.Tensor:
    blocks = [7, 3, 9, 1, 12]
    (first,) = run_step(model, [(tokens[:7], 0, blocks)])
    (chunk,) = run_step(model, [(tokens[7:12], 7, blocks)])
    decodes = [run_step(model, [([tokens[p]], p, blocks)])[0] for p in range(12, len(tokens))]
    return torch.cat([first, chunk, *decodes])


@pytest.mark.parametrize("name", NAMES)
def test_model_matches_hf_on_the_tools_dequantized_weights(name, hf_dequantized, monkeypatch):
    folder, hf = _folder(name), hf_dequantized(name)
    tokens = random_tokens(15, VOCAB, seed=1)
    expected = hf_logits(hf, tokens)
    # --quantization none: the held weights expanded to float32 at load (the float reference)
    expanded = _ours(folder, "none")
    torch.testing.assert_close(
        _prefill_chunk_decodes(expanded, tokens), expected, atol=ATOL, rtol=0
    )
    held = _ours(folder)  # detected from config.json
    assert weight_bytes(held) < weight_bytes(expanded) * 0.6
    # Held, activations kept float32: the dequantize + F.linear path, HF's numbers
    monkeypatch.setenv("KVSERVE_QUANT_ACTIVATIONS", "float32")
    torch.testing.assert_close(_prefill_chunk_decodes(held, tokens), expected, atol=ATOL, rtol=0)
    # Held, default int8 activation blocks (the VNNI kernel): teacher-forced agreement
    monkeypatch.setenv("KVSERVE_QUANT_ACTIVATIONS", "int8")
    got = _prefill_chunk_decodes(held, tokens)
    flips = int((got.argmax(-1) != expected.argmax(-1)).sum())
    delta = (got.log_softmax(-1) - expected.log_softmax(-1)).abs().mean().item()
    assert flips <= 1 and delta < 0.05, (flips, delta)  # of 15 teacher-forced positions


def test_tensor_parallel_2_splits_whole_groups(tmp_path, hf_dequantized, monkeypatch):
    # K = 64 and 128 split in two: each rank holds whole groups of 32 (zero points packed
    # along N split with the rows of the column-parallel layers)
    name = "ct_w4a16_asym_g32"
    monkeypatch.setenv("KVSERVE_QUANT_ACTIVATIONS", "float32")
    requests = [(random_tokens(9, VOCAB, seed=4), 0, [0, 1, 2])]
    assert_tensor_parallel_2_matches_hf(tmp_path, _folder(name), hf_dequantized(name), requests)


def test_a_split_that_cuts_a_group_or_an_act_order_weight_is_refused():
    q, zeros = torch.randint(0, 16, (8, 256)), torch.full((8, 2), 8)
    g128 = pack_w4(q, torch.rand(8, 2), zeros, 128)
    assert g128.qtype == "W4G128" and g128.narrow(1, 128, 128).shape == (8, 128)
    with pytest.raises(ValueError, match="blocks hold 128 input features"):
        g128.narrow(1, 0, 64)
    # one group spanning K (group 128 over K = 128, or per channel): any multiple of 32 splits
    whole = _held("ct_w4a16_g128")["model.layers.0.self_attn.o_proj.weight"]
    assert whole.qtype == "W4G32" and whole.narrow(1, 64, 64).shape == (128, 64)
    act = _held("gptq_g32_act")["model.layers.0.mlp.down_proj.weight"]
    with pytest.raises(ValueError, match="act-order"):
        act.narrow(1, 0, 64)
    assert act.narrow(0, 0, 16).perm is act.perm  # column-parallel rows keep the order


def test_act_order_shards_of_one_fused_layer_keep_their_own_order():
    held = _held("gptq_g32_act")
    q = held["model.layers.0.self_attn.q_proj.weight"]
    k = held["model.layers.0.self_attn.k_proj.weight"]
    assert not torch.equal(q.perm, k.perm)  # the writer draws one order per linear
    model = _ours(_folder("gptq_g32_act"))
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert len(qkv.quant_parts) == 3  # not concatenated: each gathers its own x[:, perm]


def _edited(tmp_path, name: str, **changes) -> str:
    folder = tmp_path / name
    shutil.copytree(_folder(name), folder)
    with open(folder / "config.json") as f:
        config = json.load(f)
    config["quantization_config"].update(changes)
    with open(folder / "config.json", "w") as f:
        json.dump(config, f)
    return str(folder)


@pytest.mark.parametrize(
    ("name", "changes", "message"),
    [
        ("awq_g32", {"version": "gemv"}, "AWQ version 'gemv'"),
        ("awq_g32", {"zero_point": False}, "zero_point: false"),
        ("gptq_g32_act", {"bits": 8}, "of 8 bits"),
        ("gptq_g32_act", {"checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
        ("gptq_g32_act", {"group_size": 16}, "group_size 16"),
        ("ct_w4a16_g128", {"format": "float-quantized"}, "format 'float-quantized'"),
    ],
)
def test_unsupported_options_are_refused_naming_them(tmp_path, name, changes, message):
    folder = _edited(tmp_path, name, **changes)
    if name.startswith("ct"):  # the group's own format wins over the config's
        with open(f"{folder}/config.json") as f:
            config = json.load(f)
        config["quantization_config"]["config_groups"]["group_0"]["format"] = changes["format"]
        with open(f"{folder}/config.json", "w") as f:
            json.dump(config, f)
    with pytest.raises(ValueError, match=message):
        load_model(folder, torch.float32, "cpu")


def test_compressed_tensors_8_bit_pack_quantized_is_refused(tmp_path):
    folder = _edited(tmp_path, "ct_w4a16_g128")
    with open(f"{folder}/config.json") as f:
        config = json.load(f)
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"] = 8
    with open(f"{folder}/config.json", "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match="int 8-bit weights are not supported"):
        checkpoint_quantization(folder)


def test_quantization_flag_must_match_the_checkpoint():
    folder = _folder("gptq_g32_act")
    assert resolve_quantization(None, folder, folder) == ("gptq", None)
    assert resolve_quantization("gptq", folder, folder) == ("gptq", None)
    with pytest.raises(ValueError, match="--quantization awq .* quant_method 'gptq'"):
        resolve_quantization("awq", folder, folder)


@pytest.mark.parametrize("g", [32, 64, 128])
def test_kernel_paths_agree_at_every_row_count(g):
    # The integer kernel (few rows), the chunked float path (many rows) and the torch
    # reference, on an act-order weight with a bias
    torch.manual_seed(g)
    n, k = 96, 256
    q = torch.randint(0, 16, (n, k))
    scales = torch.rand(n, k // g).to(torch.bfloat16) * 0.02
    zeros = torch.randint(0, 16, (n, k // g))
    g_idx = (torch.arange(k) // g)[torch.randperm(k)]
    qt = pack_w4(q, scales, zeros, g, g_idx)
    assert qt.qtype == f"W4G{g}"
    w = (q.float() - zeros.float()[:, g_idx]) * scales.float()[:, g_idx]
    assert torch.equal(qt.dequantize(), w)
    bias = torch.randn(n)
    for m in (1, 2, 3, 4, 7, int4.W4_C_ROWS_MAX, int4.W4_C_ROWS_MAX + 1, 200):
        x = torch.randn(m, k)
        expected = x @ w.t() + bias
        scale = expected.abs().max()
        got = quant_linear(x, qt, bias)
        assert (got - expected).abs().max() / scale < 0.02, m
        out = torch.zeros(m, n + 8)
        quant_linear(x, qt, bias, out=out[:, 4 : 4 + n])
        torch.testing.assert_close(out[:, 4 : 4 + n], got, atol=1e-5, rtol=0)
        ref = int4.w4_linear_ref(x, qt, bias)
        torch.testing.assert_close(ref, expected, atol=1e-4, rtol=1e-5)


def _stack_bound(folder: str, max_requests: int):
    from kvserve.services.worker.models.native_decode import bind_decode_stack

    model = _ours(folder)
    return model, bind_decode_stack(model, torch.float32, max_requests)


def test_w4_groups_run_inside_the_native_decode_stack():
    # The stack calls int4_gemm.c's w4_any_linear for the W4G parts: its steps equal the
    # module path's (the same kernel per layer)
    folder = _folder("ct_w4a16_asym_g32")
    native, status = _stack_bound(folder, 8)
    assert status.startswith("on"), status
    modules, _ = _stack_bound(folder, 0)
    assert modules.model.decode_stack is None
    prompt = random_tokens(9, VOCAB, seed=5)
    blocks = [0, 1, 2, 3]
    for model in (native, modules):
        run_step(model, [(prompt[:6], 0, blocks)])
    for pos in range(6, 9):
        got = run_step(native, [([prompt[pos]], pos, blocks)])[0]
        want = run_step(modules, [([prompt[pos]], pos, blocks)])[0]
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    act, status = _stack_bound(_folder("gptq_g32_act"), 8)
    assert "act-order" in status and act.model.decode_stack is None
