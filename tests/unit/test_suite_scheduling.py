"""The order and grouping of test modules on pytest-xdist's workers
(tests/support/scheduling.py)."""

from __future__ import annotations

import json

from tests.support import REPO_ROOT
from tests.support.api_server import SHARED_SERVER_MODULES
from tests.support.scheduling import (
    MODULE_SECONDS_PATH,
    SHARED_SERVER_UNIT,
    THREE_ENGINE_MODULES,
    THREE_ENGINE_UNIT,
    longest_first,
    merged_module_seconds,
    module_seconds_of_junit,
    unit_of,
)


def test_grouped_modules_are_one_unit_and_the_rest_their_own():
    for module in THREE_ENGINE_MODULES:
        assert unit_of(f"{module}::test_x[a-b]") == THREE_ENGINE_UNIT
    for module in SHARED_SERVER_MODULES:
        assert unit_of(f"{module}::test_x") == SHARED_SERVER_UNIT
    assert unit_of("tests/unit/test_y.py::Class::test_z") == "tests/unit/test_y.py"


def test_the_longest_recorded_units_go_first_the_unrecorded_last_in_their_order():
    recorded = json.loads(MODULE_SECONDS_PATH.read_text())
    longest = max(recorded, key=recorded.get)
    units = ["tests/unit/test_new_b.py", "tests/unit/test_new_a.py", longest, THREE_ENGINE_UNIT]
    order = longest_first(units)
    assert order[-2:] == ["tests/unit/test_new_b.py", "tests/unit/test_new_a.py"]
    assert sum(recorded[m] for m in THREE_ENGINE_MODULES) > recorded[longest]
    assert order[:2] == [THREE_ENGINE_UNIT, longest]


def test_every_recorded_and_grouped_module_exists():
    recorded = json.loads(MODULE_SECONDS_PATH.read_text())
    for module in [*recorded, *THREE_ENGINE_MODULES]:
        assert (REPO_ROOT / module).is_file(), f"{module}: rename it in tests/support/scheduling"


def test_module_seconds_sum_a_junit_files_cases_per_module(tmp_path):
    junit = tmp_path / "junit.xml"
    junit.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.e2e.test_a" name="t1" time="4.5"/>'
        '<testcase classname="tests.e2e.test_a.TestGroup" name="t2" time="1.0"/>'
        '<testcase classname="tests.unit.test_b" name="t3" time="0.2"/>'
        "</testsuite></testsuites>"
    )
    assert module_seconds_of_junit(str(junit)) == {"tests/e2e/test_a.py": 6}


def test_a_partial_junit_replaces_its_modules_and_keeps_the_others(tmp_path):
    junit = tmp_path / "junit.xml"
    junit.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.e2e.test_a" name="t1" time="40.4"/>'
        '<testcase classname="tests.unit.test_b" name="t2" time="0.2"/>'
        "</testsuite></testsuites>"
    )
    recorded = {"tests/e2e/test_a.py": 90, "tests/unit/test_b.py": 30, "tests/e2e/test_c.py": 60}
    merged = merged_module_seconds(recorded, str(junit))
    # test_a measured anew, test_b now too short to record, test_c (not run) kept.
    assert merged == {"tests/e2e/test_c.py": 60, "tests/e2e/test_a.py": 40}
    assert list(merged) == ["tests/e2e/test_c.py", "tests/e2e/test_a.py"]  # longest first
