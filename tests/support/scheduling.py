"""The order `-n 2 --dist loadfile` hands test modules to pytest-xdist's workers.

The run ends when the slower worker ends, so the longest modules go first: a long module
handed out last would run alone while the other worker idles. Each module's seconds come
from a recorded run (tests/data/module_seconds.json; refresh it with
`python -m tests.support.scheduling JUNIT_XML` after `pytest --junitxml JUNIT_XML`, of the
whole suite or of the modules that changed: the others keep their entries); a module
it does not list is taken for a short one and keeps its collection order after the listed.

Two groups of modules are each one unit (one worker runs them back to back):
- the modules that share the API server (tests/support/api_server.py): one worker builds it;
- the modules whose tests start three engine processes at once (P/D, migration, supervision:
  ~1.6 GiB each): on two workers they overlapped and took the run over its memory budget.

Run as a script, it merges a junit XML file's modules into module_seconds.json.
"""

from __future__ import annotations

import collections
import json
import sys
import xml.etree.ElementTree as ElementTree

from tests.support import REPO_ROOT
from tests.support.api_server import uses_shared_server

MODULE_SECONDS_PATH = REPO_ROOT / "tests" / "data" / "module_seconds.json"
SHARED_SERVER_UNIT = "shared-api-server"
THREE_ENGINE_UNIT = "three-engine-servers"
THREE_ENGINE_MODULES = (
    "tests/e2e/test_pd_serving.py",
    "tests/faults/test_migration.py",
    "tests/faults/test_faults_supervision.py",
)
_MIN_RECORDED_S = 5  # shorter modules are not recorded: their order matters little


def unit_of(nodeid: str) -> str:
    """The work unit of a test: its module, or the group its module belongs to."""
    module = nodeid.split("::", 1)[0]
    if uses_shared_server(nodeid):
        return SHARED_SERVER_UNIT
    if module in THREE_ENGINE_MODULES:
        return THREE_ENGINE_UNIT
    return module


def unit_seconds(units: list[str]) -> dict[str, float]:
    """Each unit's recorded seconds (a group: the sum over its modules; unrecorded: 0).

    Args:
        units: the units to weigh.
    """
    recorded = json.loads(MODULE_SECONDS_PATH.read_text())
    seconds: dict[str, float] = dict.fromkeys(units, 0.0)
    for module, module_seconds in recorded.items():
        unit = unit_of(module)
        if unit in seconds:
            seconds[unit] += module_seconds
    return seconds


def longest_first(units: list[str]) -> list[str]:
    """The units, longest recorded first; the unrecorded keep their order, after the rest.

    Args:
        units: the units in collection order.
    """
    seconds = unit_seconds(units)
    return sorted(units, key=lambda unit: -seconds[unit])  # sorted() is stable


def _seconds_per_module(junit_path: str) -> collections.Counter[str]:
    """Seconds per test module (path as in node ids) of every module in a junit XML file."""
    seconds: collections.Counter[str] = collections.Counter()
    for case in ElementTree.parse(junit_path).iter("testcase"):
        parts = case.get("classname", "").split(".")
        # classname is the module's dotted path, then the test class if any.
        ends = [i for i, part in enumerate(parts) if part.startswith("test_")]
        module = "/".join(parts[: ends[0] + 1] if ends else parts) + ".py"
        seconds[module] += float(case.get("time", 0))
    return seconds


def module_seconds_of_junit(junit_path: str) -> dict[str, int]:
    """Seconds per test module (path as in node ids) of a pytest junit XML file, longest
    first, the modules of at least _MIN_RECORDED_S seconds.

    Args:
        junit_path: what `pytest --junitxml` wrote.
    """
    seconds = _seconds_per_module(junit_path)
    return {m: round(s) for m, s in seconds.most_common() if s >= _MIN_RECORDED_S}


def merged_module_seconds(recorded: dict[str, int], junit_path: str) -> dict[str, int]:
    """The record with the modules junit_path ran measured anew, longest first: a run of a
    few modules replaces their entries and keeps every other module's; a module that ran
    in under _MIN_RECORDED_S seconds leaves the record.

    Args:
        recorded: the current record (module_seconds.json).
        junit_path: what `pytest --junitxml` wrote, for the whole suite or a few modules.
    """
    measured = _seconds_per_module(junit_path)
    merged = {m: s for m, s in recorded.items() if m not in measured}
    merged.update({m: round(s) for m, s in measured.items() if s >= _MIN_RECORDED_S})
    return dict(sorted(merged.items(), key=lambda item: -item[1]))


if __name__ == "__main__":
    recorded = merged_module_seconds(json.loads(MODULE_SECONDS_PATH.read_text()), sys.argv[1])
    MODULE_SECONDS_PATH.write_text(json.dumps(recorded, indent=1) + "\n")
    print(f"{len(recorded)} modules, {sum(recorded.values())} s -> {MODULE_SECONDS_PATH}")
