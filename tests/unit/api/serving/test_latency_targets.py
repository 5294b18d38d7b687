"""Latency targets in (services/api/serving/latency_targets.py): the `slo` body field, the
x-slo-* headers and the key file's slo_* columns, their precedence, the 400s, and the
targets on each EngineCoreRequest."""

from __future__ import annotations

import math

import pytest
from starlette.datastructures import Headers

from kvserve.services.api.serving.errors import APIError
from kvserve.services.api.serving.latency_targets import LatencyTargets, resolve_targets
from kvserve.services.api.serving.output_processor import make_engine_requests
from kvserve.services.api.serving.protocol import ChatCompletionRequest, decode_request
from kvserve.services.api.surfaces.anthropic_protocol import MessagesRequest
from kvserve.services.api.surfaces.openai_protocol import CompletionRequest
from kvserve.services.api.surfaces.responses_protocol import ResponsesRequest
from kvserve.services.api.tenancy.tenants import TenantSpec, parse_key_file
from kvserve.shared.sampling_params import SamplingParams

TENANT = TenantSpec(name="search", slo_ttft_ms=500.0, slo_tpot_ms=50.0)


def _headers(**values: str) -> Headers:
    return Headers({name.replace("_", "-"): value for name, value in values.items()})


def test_no_targets_anywhere_is_none():
    assert resolve_targets(None, _headers(), None) == LatencyTargets()
    assert not resolve_targets(None, _headers(), TenantSpec(name="default")).any


def test_body_beats_header_beats_tenant_per_target():
    body = LatencyTargets(ttft_ms=100.0)
    headers = _headers(x_slo_ttft_ms="200", x_slo_tpot_ms="20")
    assert resolve_targets(body, headers, TENANT) == LatencyTargets(ttft_ms=100.0, tpot_ms=20.0)
    assert resolve_targets(None, headers, TENANT) == LatencyTargets(ttft_ms=200.0, tpot_ms=20.0)
    assert resolve_targets(None, _headers(), TENANT) == LatencyTargets(ttft_ms=500.0, tpot_ms=50.0)
    assert resolve_targets(body, _headers(), TENANT) == LatencyTargets(ttft_ms=100.0, tpot_ms=50.0)


@pytest.mark.parametrize("value", ["abc", "0", "-5", "nan", "inf", ""])
def test_a_bad_header_is_a_400(value):
    with pytest.raises(APIError) as info:
        resolve_targets(None, _headers(x_slo_tpot_ms=value), None)
    assert info.value.status_code == 400
    assert "x-slo-tpot-ms" in info.value.message


def test_an_infinite_body_value_is_a_400():
    with pytest.raises(APIError) as info:
        resolve_targets(LatencyTargets(ttft_ms=math.inf), _headers(), None)
    assert info.value.status_code == 400


@pytest.mark.parametrize(
    "request_type, base",
    [
        (CompletionRequest, b'"prompt": "hi"'),
        (ChatCompletionRequest, b'"messages": [{"role": "user", "content": "hi"}]'),
        (ResponsesRequest, b'"input": "hi"'),
        (
            MessagesRequest,
            b'"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]',
        ),
    ],
)
def test_every_surface_takes_the_slo_field(request_type, base):
    body = decode_request(
        b"{" + base + b', "slo": {"ttft_ms": 250, "tpot_ms": 12.5}}', request_type
    )
    assert body.slo == LatencyTargets(ttft_ms=250.0, tpot_ms=12.5)
    assert decode_request(b"{" + base + b"}", request_type).slo is None
    for bad in (
        b'{"ttft_ms": 0}',
        b'{"ttft_ms": -1}',
        b'{"ttft_ms": "fast"}',
        b'{"deadline_ms": 5}',
        b"250",
        b'"250"',
        b'{"ttft_ms": NaN}',
    ):
        with pytest.raises(APIError) as info:
            decode_request(b"{" + base + b', "slo": ' + bad + b"}", request_type)
        assert info.value.status_code == 400, bad


def test_key_file_slo_columns(tmp_path):
    path = tmp_path / "keys"
    path.write_text("search:sk-1 weight=2 slo_ttft_ms=500 slo_tpot_ms=40.5\nbatch:sk-2\n")
    lines = parse_key_file(str(path))
    assert lines[0].options == {"weight": 2.0, "slo_ttft_ms": 500.0, "slo_tpot_ms": 40.5}
    assert lines[1].options == {}


@pytest.mark.parametrize("value", ["0", "-1", "abc", "inf", "nan"])
def test_a_bad_key_file_slo_value_names_the_line(tmp_path, value):
    path = tmp_path / "keys"
    path.write_text(f"# keys\nsearch:sk-1 slo_ttft_ms={value}\n")
    with pytest.raises(ValueError, match="line 2: slo_ttft_ms"):
        parse_key_file(str(path))


class _TokenizerInfo:
    extra_stop_token_ids: list[int] = []
    eos_token_id = 2


def test_engine_requests_carry_the_targets():
    params = SamplingParams(max_tokens=4, n=2)
    targets = LatencyTargets(ttft_ms=300.0, tpot_ms=None)
    requests = make_engine_requests(
        ["a", "b"], [1, 2], params, 0, _TokenizerInfo(), None, None, None, targets
    )
    assert [(r.slo_ttft_ms, r.slo_tpot_ms) for r in requests] == [(300.0, None)] * 2
    untargeted = make_engine_requests(["c"], [1, 2], params, 0, _TokenizerInfo())
    assert (untargeted[0].slo_ttft_ms, untargeted[0].slo_tpot_ms) == (None, None)
