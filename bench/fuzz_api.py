"""Fuzz the HTTP API from its /openapi.json (schemathesis), at full length.

    PYTHONPATH=. .venv/bin/python bench/fuzz_api.py --examples 200
    PYTHONPATH=. .venv/bin/python bench/fuzz_api.py --url http://127.0.0.1:8000 --api-key KEY

Without --url it serves the tiny random model (tests/support/models.py) with the flags of
the CI run (tests/e2e/test_api_fuzz.py), which sends 20 cases per operation and mode; this
sends --examples. It prints the number of requests, the status counts, the server errors
(5xx, hangs, dropped connections, each with its body) and whether the engine still serves,
and exits 1 on any of them.
"""

from __future__ import annotations

import argparse
import contextlib
import secrets
import sys
import tempfile

import httpx

from tests.e2e.test_api_fuzz import FUZZ_SERVE_ARGS
from tests.support.fuzz import fuzz
from tests.support.models import build_tiny_llama
from tests.support.server import serving


def engine_serves(url: str, headers: dict[str, str]) -> bool:
    """/health is healthy and a completion comes back with its tokens."""
    if httpx.get(url + "/health", timeout=10).status_code != 200:
        return False
    response = httpx.post(
        url + "/v1/completions",
        json={"prompt": "hi", "max_tokens": 3, "ignore_eos": True},
        headers=headers,
        timeout=60,
    )
    return response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 3


@contextlib.contextmanager
def tiny_server(key: str):
    with tempfile.TemporaryDirectory() as folder:
        model_dir = build_tiny_llama(f"{folder}/tiny-llama")
        with open(f"{folder}/keys", "w") as f:
            f.write(f"fuzzer:{key}\n")
        args = [model_dir, *FUZZ_SERVE_ARGS, "--api-key-file", f"{folder}/keys"]
        print(f"serving the tiny model: kvserve serve {' '.join(args)}", flush=True)
        with serving(args, f"{folder}/serve.log") as url:
            yield url


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running server (default: serve the tiny model)")
    parser.add_argument("--api-key", help="the server's API key, if it needs one")
    parser.add_argument("--examples", type=int, default=200, help="cases per operation and mode")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds before a hang")
    args = parser.parse_args()

    key = args.api_key or ("" if args.url else secrets.token_hex(8))
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    server = contextlib.nullcontext(args.url) if args.url else tiny_server(key)
    with server as url:
        report = fuzz(url, args.examples, headers, args.seed, args.timeout)
        alive = engine_serves(url, headers)
    print(report.summary())
    for operation, what, body in report.failures:
        print(f"FAILED {operation}: {what}\n    body: {body}")
    print(f"engine serves afterwards: {alive}")
    return 0 if alive and not report.failures and not report.num_server_errors else 1


if __name__ == "__main__":
    sys.exit(main())
