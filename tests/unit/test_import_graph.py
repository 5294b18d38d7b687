"""The import-graph checker (.ci/check_imports.py) on small synthetic trees."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from tests.support import REPO_ROOT


def _load_checker():
    # .ci is no package: load the script from its file.
    path = REPO_ROOT / ".ci" / "check_imports.py"
    spec = importlib.util.spec_from_file_location("check_imports", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


check_imports = _load_checker()

# One module per layer, each importing only what the layering allows.
CLEAN_TREE = {
    "kvserve/__init__.py": "from kvserve.shared.config import Config\n",
    "kvserve/cli.py": "from kvserve.services.api import server\n",
    "shared/__init__.py": "",
    "shared/config.py": "import msgspec\n",
    "services/__init__.py": "",
    "services/api/__init__.py": "",
    "services/api/server.py": "from kvserve.shared.config import Config\nfrom . import protocol\n",
    "services/api/protocol.py": "from ..scheduler.request import Request\n",
    "services/scheduler/__init__.py": "",
    "services/scheduler/request.py": "from kvserve.shared import config\n",
    "services/worker/__init__.py": "",
    "services/worker/runner.py": "import torch\nfrom kvserve.kernels import rms_norm\n",
    "kernels/__init__.py": "from .norm import rms_norm\n",
    "kernels/norm.py": "import torch\n\nfrom kvserve.shared.config import Config\n",
    # Not in a package, so it does not ship: its old-name import must not count.
    "kernels/csrc/gen.py": "import kernels\n",
}


def _write_tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def _check(tmp_path: Path, changes: dict[str, str] | None = None):
    """Check CLEAN_TREE with some files changed or added."""
    return check_imports.check(_write_tree(tmp_path, {**CLEAN_TREE, **(changes or {})}))


def test_clean_tree_passes(tmp_path):
    report = _check(tmp_path)
    assert report.ok, report.failures()
    assert "kvserve.kernels.csrc.gen" not in report.modules
    assert len(report.modules) == 14
    assert report.summary() == (
        "import graph: 14 modules, 9 edges (0 under TYPE_CHECKING only), no cycles"
    )
    assert ("kvserve.services.worker.runner", "kvserve.kernels") in report.edges


def test_cycle_through_function_level_import_is_found(tmp_path):
    report = _check(
        tmp_path,
        {
            "shared/a.py": "from kvserve.shared import b\n",
            "shared/b.py": "def load():\n    from kvserve.shared.a import x\n",
        },
    )
    assert [check_imports.format_cycle(cycle) for cycle in report.cycles] == [
        "kvserve.shared.a:1 -> kvserve.shared.b:2 -> kvserve.shared.a"
    ]
    assert not report.ok


def test_submodule_importing_its_package_is_a_cycle(tmp_path):
    report = _check(
        tmp_path,
        {
            "kvserve/benchmarks/__init__.py": "def add_parser():\n    from . import serve\n",
            "kvserve/benchmarks/serve.py": "from kvserve.benchmarks import add_parser\n",
            "shared/__init__.py": "from kvserve.shared import VERSION\n",
        },
    )
    assert sorted(check_imports.format_cycle(cycle) for cycle in report.cycles) == [
        "kvserve.benchmarks:2 -> kvserve.benchmarks.serve:1 -> kvserve.benchmarks",
        "kvserve.shared:1 -> kvserve.shared",
    ]


def test_cycles_cover_every_edge_of_a_component(tmp_path):
    # a -> b -> a and a -> c -> a: one component, two cycles to break.
    report = _check(
        tmp_path,
        {
            "shared/a.py": "from . import b, c\n",
            "shared/b.py": "from . import a\n",
            "shared/c.py": "from . import a\n",
        },
    )
    hops = {(imp.source, imp.target) for cycle in report.cycles for imp in cycle}
    assert len(report.cycles) == 2
    a, b, c = "kvserve.shared.a", "kvserve.shared.b", "kvserve.shared.c"
    assert hops == {(a, b), (b, a), (a, c), (c, a)}


def test_relative_imports_resolve(tmp_path):
    report = _check(
        tmp_path,
        {
            "kernels/sub/__init__.py": "from . import act\n",
            "kernels/sub/act.py": "from ..norm import rms_norm\nfrom .. import norm\n"
            "from .fast import gelu\n",
            "kernels/sub/fast.py": "from ... import kernels\n",
        },
    )
    edges = {edge for edge in report.edges if edge[0].startswith("kvserve.kernels.sub")}
    # `from .. import norm` names a submodule: an edge to norm, none to kvserve.kernels.
    assert edges == {
        ("kvserve.kernels.sub", "kvserve.kernels.sub.act"),
        ("kvserve.kernels.sub.act", "kvserve.kernels.norm"),
        ("kvserve.kernels.sub.act", "kvserve.kernels.sub.fast"),
        ("kvserve.kernels.sub.fast", "kvserve.kernels"),
    }
    assert report.ok, report.failures()


def test_layering_violations_are_found(tmp_path):
    report = _check(
        tmp_path,
        {
            "services/api/server.py": "from typing import TYPE_CHECKING\n"
            "from kvserve.services.worker import runner\n"
            "if TYPE_CHECKING:\n    import torch\n",
            "services/scheduler/request.py": "from kvserve.services.api.protocol import Message\n",
            "shared/config.py": "def default():\n    from kvserve import Config\n",
            "kernels/norm.py": "import kvserve.cli\n",
        },
    )
    assert sorted(f"{imp.where()} {imp.target}" for imp, _ in report.layering) == [
        "kvserve.kernels.norm:1 kvserve.cli",
        "kvserve.services.api.server:2 kvserve.services.worker.runner",
        "kvserve.services.api.server:4 (TYPE_CHECKING) torch",
        "kvserve.services.scheduler.request:1 kvserve.services.api.protocol",
        "kvserve.shared.config:2 kvserve",
    ]
    assert not report.ok


def test_scheduler_subpackages_and_training_keep_their_layers(tmp_path):
    report = _check(
        tmp_path,
        {
            "services/scheduler/core/__init__.py": "",
            "services/scheduler/core/scheduler.py": "import torch\n"
            "from kvserve.services.scheduler.executors import executor\n"
            "from kvserve.services.worker.runner import Runner\n",
            "services/scheduler/engine/__init__.py": "from . import engine_core\n",
            "services/scheduler/engine/engine_core.py": "from ..core import scheduler\n"
            "from ..structured_output import grammar\n",
            "services/scheduler/executors/__init__.py": "",
            "services/scheduler/executors/executor.py": "",
            "services/scheduler/structured_output/__init__.py": "",
            "services/scheduler/structured_output/grammar.py": "from ..engine import engine_core\n"
            "from kvserve.shared import config\n",
            "services/worker/spec.py": "from kvserve.training import train_draft\n",
            "kvserve/training/__init__.py": "",
            "kvserve/training/train_draft.py": "from kvserve.services.worker import runner\n",
        },
    )
    assert sorted(f"{imp.where()} {imp.target}" for imp, _ in report.layering) == [
        "kvserve.services.scheduler.core.scheduler:1 torch",
        "kvserve.services.scheduler.core.scheduler:2 kvserve.services.scheduler.executors.executor",
        "kvserve.services.scheduler.core.scheduler:3 kvserve.services.worker.runner",
        "kvserve.services.scheduler.structured_output.grammar:1 "
        "kvserve.services.scheduler.engine.engine_core",
        "kvserve.services.worker.spec:1 kvserve.training.train_draft",
    ]


def test_api_subpackages_keep_their_layers(tmp_path):
    api = "services/api"
    files = {
        f"{api}/{sub}/__init__.py": ""
        for sub in ("surfaces", "serving", "parsers", "engine_client", "tenancy", "observability")
    }
    files |= {
        # Allowed: a surface over the serving core, the parsers and EngineClient; the engine
        # client over the output side of serving; tenancy over serving's errors.
        f"{api}/surfaces/chat.py": "from kvserve.services.api.serving import base\n"
        "from kvserve.services.api.parsers import tool_calls\n"
        "from kvserve.services.api.engine_client.client import EngineClient\n"
        "from kvserve.services.api.engine_client import liveness\n",
        f"{api}/serving/base.py": "from kvserve.services.api.engine_client import client\n"
        "from kvserve.services.api.surfaces import chat\n",
        f"{api}/serving/errors.py": "",
        f"{api}/serving/outputs.py": "",
        f"{api}/serving/validation.py": "",
        f"{api}/parsers/tool_calls.py": "from kvserve.services.api.serving import errors\n"
        "from kvserve.services.api.tenancy import tenants\n",
        f"{api}/engine_client/client.py": "from kvserve.services.api.serving import outputs\n"
        "from kvserve.services.api.tenancy import tenants\n"
        "from kvserve.services.api.serving.validation import check\n",
        f"{api}/engine_client/liveness.py": "from . import client\n",
        f"{api}/tenancy/tenants.py": "from kvserve.services.api.serving.errors import APIError\n"
        "from kvserve.services.api.engine_client import client\n",
        f"{api}/observability/dashboard.py": "from ..engine_client import client\n"
        "from ..engine_client import liveness\n"
        "from kvserve.services.api import server\n",
    }
    report = _check(tmp_path, files)
    assert sorted(f"{imp.where()} {imp.target}" for imp, _ in report.layering) == [
        "kvserve.services.api.engine_client.client:3 kvserve.services.api.serving.validation",
        "kvserve.services.api.observability.dashboard:2 "
        "kvserve.services.api.engine_client.liveness",
        "kvserve.services.api.observability.dashboard:3 kvserve.services.api.server",
        "kvserve.services.api.parsers.tool_calls:2 kvserve.services.api.tenancy.tenants",
        "kvserve.services.api.serving.base:2 kvserve.services.api.surfaces.chat",
        "kvserve.services.api.surfaces.chat:4 kvserve.services.api.engine_client.liveness",
        "kvserve.services.api.tenancy.tenants:2 kvserve.services.api.engine_client.client",
    ]


def test_package_folders_come_from_pyproject(tmp_path):
    # The mapping is pyproject.toml's [tool.setuptools.package-dir]; a new folder is checked
    # under the package it installs as, and its folder name becomes an old top-level name.
    root = _write_tree(
        tmp_path,
        {
            "pyproject.toml": '[tool.setuptools.package-dir]\n"kvserve" = "kvserve"\n'
            '"kvserve.plugins" = "plugins"\n',
            "kvserve/__init__.py": "",
            "plugins/__init__.py": "",
            "plugins/loader.py": "from kvserve.plugins import registry\n",
            "plugins/registry.py": "",
        },
    )
    package_dirs = check_imports.read_package_dirs(root)
    assert package_dirs == {"kvserve": "kvserve", "kvserve.plugins": "plugins"}
    report = check_imports.check(root, package_dirs)
    assert set(report.modules) == {
        "kvserve",
        "kvserve.plugins",
        "kvserve.plugins.loader",
        "kvserve.plugins.registry",
    }
    assert report.ok, report.failures()
    assert check_imports.read_package_dirs() == check_imports.PACKAGE_DIRS
    assert check_imports.OLD_TOP_LEVEL_NAMES == tuple(
        folder for package, folder in check_imports.PACKAGE_DIRS.items() if package != "kvserve"
    )


def test_only_main_may_import_the_cli(tmp_path):
    report = _check(
        tmp_path,
        {
            "kvserve/__main__.py": "from kvserve.cli import main\n",
            "kvserve/llm.py": "from kvserve import cli\n",
        },
    )
    assert [imp.where() for imp, _ in report.layering] == ["kvserve.llm:1"]


def test_old_names_and_missing_modules_are_found(tmp_path):
    report = _check(
        tmp_path,
        {
            "services/api/server.py": "from shared.config import Config\n"
            "import kvserve.services.api.gone\n",
        },
    )
    assert [imp.target for imp in report.old_names] == ["shared.config"]
    assert [imp.target for imp in report.missing] == ["kvserve.services.api.gone"]


def test_main_prints_failures_then_summary(tmp_path, capsys):
    _write_tree(tmp_path, {**CLEAN_TREE, "services/api/protocol.py": "import kernels.norm\n"})
    assert check_imports.main(["check_imports.py", str(tmp_path)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "old name: kvserve.services.api.protocol:1 imports kernels.norm"
    assert lines[-1].startswith("import graph: 14 modules")


def test_real_repository_parses():
    # Only that it parses: the repository's own cycles are being fixed separately.
    report = check_imports.check(REPO_ROOT)
    assert isinstance(report, check_imports.Report)
    assert {"kvserve.cli", "kvserve.shared.config", "kvserve.kernels"} <= set(report.modules)
    assert report.edges
