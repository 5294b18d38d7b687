"""Fuzz a running server from its /openapi.json with schemathesis: bodies that fit the
schemas (positive) and bodies that do not (negative), for every operation.

Shared by the bounded CI test (tests/e2e/test_api_fuzz.py) and the full-length run
(bench/fuzz_api.py). A case passes when the server answers below 500 within the timeout; a
5xx, a hang or a dropped connection is recorded with the request that caused it.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field

import hypothesis
import requests
import schemathesis
from hypothesis import HealthCheck, Phase
from schemathesis.generation.modes import GenerationMode

MODES = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)


@dataclass
class FuzzReport:
    """What a fuzz run sent and got.

    Args:
        num_requests: requests sent.
        status_counts: HTTP status -> count.
        failures: (operation, what went wrong, the body sent) of each 5xx, hang or drop.
        seconds: the run's wall time.
    """

    num_requests: int = 0
    status_counts: collections.Counter = field(default_factory=collections.Counter)
    failures: list[tuple[str, str, str]] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def num_server_errors(self) -> int:
        return sum(count for status, count in self.status_counts.items() if status >= 500)

    def summary(self) -> str:
        counts = ", ".join(f"{s}: {n}" for s, n in sorted(self.status_counts.items()))
        return (
            f"{self.num_requests} requests in {self.seconds:.0f} s; status counts {{{counts}}}; "
            f"{self.num_server_errors} server errors; {len(self.failures)} failures"
        )


def fuzz(
    url: str,
    max_examples: int,
    headers: dict[str, str] | None = None,
    seed: int = 0,
    timeout_s: float = 60.0,
    operations: tuple[str, ...] | None = None,
) -> FuzzReport:
    """Send up to `max_examples` cases per operation and generation mode.

    Args:
        url: the server's base URL (its /openapi.json is read).
        max_examples: cases per (operation, positive/negative).
        headers: sent with every case (an API key).
        seed: hypothesis' seed: the same seed sends the same cases.
        timeout_s: a case without an answer by then is a hang (a failure).
        operations: only these paths (default: every one).
    """
    document = requests.get(url + "/openapi.json", headers=headers, timeout=timeout_s).json()
    schemas = {
        # JSON Schema calls 5.0 an integer and hypothesis writes bounded integers as such
        # floats, which the server's decoder (rightly) refuses: the positive cases get the
        # schema without the 64-bit bounds, so that they reach the engine with real
        # integers (huge ones included); the negative cases keep the bounds to cross.
        GenerationMode.POSITIVE: schemathesis.openapi.from_dict(_without_int64_bounds(document)),
        GenerationMode.NEGATIVE: schemathesis.openapi.from_dict(document),
    }
    report = FuzzReport()
    session = requests.Session()
    start = time.perf_counter()
    for mode in MODES:
        for result in schemas[mode].get_all_operations():
            operation = result.ok()
            if operations is not None and operation.path not in operations:
                continue
            _fuzz_operation(
                operation, mode, url, max_examples, headers, seed, timeout_s, session, report
            )
    report.seconds = time.perf_counter() - start
    return report


def _fuzz_operation(
    operation, mode, url, max_examples, headers, seed, timeout_s, session, report: FuzzReport
) -> None:
    name = f"{operation.method.upper()} {operation.path} ({mode.value})"

    @hypothesis.seed(seed)
    @hypothesis.settings(
        max_examples=max_examples,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )
    @hypothesis.given(operation.as_strategy(generation_mode=mode))
    def run(case) -> None:
        report.num_requests += 1
        try:
            response = case.call(base_url=url, session=session, headers=headers, timeout=timeout_s)
        except requests.RequestException as exc:
            report.failures.append((name, f"{type(exc).__name__}: {exc}", _body(case)))
            return
        report.status_counts[response.status_code] += 1
        if response.status_code >= 500:
            report.failures.append(
                (name, f"{response.status_code}: {response.text[:300]}", _body(case))
            )

    try:
        run()
    except hypothesis.errors.Unsatisfiable:
        pass  # nothing to vary (a GET without parameters has no negative cases)


def _without_int64_bounds(node):
    if isinstance(node, list):
        return [_without_int64_bounds(item) for item in node]
    if not isinstance(node, dict):
        return node
    bounded = node.get("minimum") == -(2**63) and node.get("maximum") == 2**63 - 1
    return {
        key: _without_int64_bounds(value)
        for key, value in node.items()
        if not (bounded and key in ("minimum", "maximum"))
    }


def _body(case) -> str:
    return repr(getattr(case, "body", None))[:500]
