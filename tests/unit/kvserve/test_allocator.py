"""kvserve/launch/allocator.py: the engine processes start with tcmalloc preloaded where the
system has it; a process spawned after the preload really maps the library."""

from __future__ import annotations

import ctypes.util
import os
import shutil
import subprocess
import sys

import pytest

from kvserve.launch import allocator


def _fake_library_dir(tmp_path, name: str) -> str:
    # A real shared library (libm: harmless to preload) under the allocator's file name.
    found = ctypes.util.find_library("m")
    source = next(
        (
            os.path.join(folder, found)
            for folder in (
                "/lib/x86_64-linux-gnu",
                "/lib/aarch64-linux-gnu",
                *allocator.SEARCH_DIRS,
            )
            if found and os.path.isfile(os.path.join(folder, found))
        ),
        None,
    )
    if source is None:
        pytest.skip("no libm file found to stand in for the allocator library")
    shutil.copy(source, tmp_path / name)
    return str(tmp_path)


def test_preload_puts_the_first_library_found_first_and_a_spawned_process_maps_it(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("KVSERVE_PRELOAD_ALLOCATOR", "1")
    folder = _fake_library_dir(tmp_path, "libjemalloc.so.2")
    environ = {"LD_PRELOAD": "/opt/other.so"}
    choice = allocator.preload_allocator(environ, [folder], str(tmp_path / "no-gpu"))
    path = os.path.join(folder, "libjemalloc.so.2")
    assert environ["LD_PRELOAD"] == f"{path}:/opt/other.so"
    assert path in choice
    # Idempotent: the library is already named, nothing is added twice.
    again = dict(environ)
    assert "already names it" in allocator.preload_allocator(again, [folder])
    assert again == environ
    env = dict(os.environ, LD_PRELOAD=path)
    maps = subprocess.run(
        [sys.executable, "-c", "print(open('/proc/self/maps').read())"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert path in maps


def test_tcmalloc_is_preferred_to_jemalloc(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSERVE_PRELOAD_ALLOCATOR", "1")
    _fake_library_dir(tmp_path, "libjemalloc.so.2")
    _fake_library_dir(tmp_path, "libtcmalloc_minimal.so.4")
    assert allocator.find_allocator([str(tmp_path)]) == str(tmp_path / "libtcmalloc_minimal.so.4")


@pytest.mark.parametrize("case", ["off", "gpu-host", "none-found"])
def test_glibc_malloc_is_kept_and_said_why(tmp_path, monkeypatch, case):
    monkeypatch.setenv("KVSERVE_PRELOAD_ALLOCATOR", "0" if case == "off" else "1")
    folder = (
        str(tmp_path) if case == "none-found" else _fake_library_dir(tmp_path, "libtcmalloc.so.4")
    )
    gpu = tmp_path / "nvidiactl"
    if case == "gpu-host":
        gpu.write_text("")
    environ: dict[str, str] = {}
    choice = allocator.preload_allocator(environ, [folder], str(gpu))
    assert environ == {}
    assert choice.startswith("glibc malloc")
    expected = {
        "off": "KVSERVE_PRELOAD_ALLOCATOR=0",
        "gpu-host": "GPU host",
        "none-found": "apt-get",
    }
    assert expected[case] in choice


def test_a_command_reexecutes_itself_under_the_allocator(tmp_path):
    # `kvserve bench throughput` runs its engine in its own process, so it restarts itself
    # with the library preloaded (once: the restarted process finds it named and goes on).
    folder = _fake_library_dir(tmp_path, "libtcmalloc_minimal.so.4")
    script = (
        "import os\n"
        "from kvserve.launch import allocator\n"
        f"allocator.SEARCH_DIRS = ({folder!r},)\n"
        f"allocator.NVIDIA_DEVICE = {str(tmp_path / 'no-gpu')!r}\n"
        "print('start', os.getpid(), flush=True)\n"
        "allocator.reexec_with_allocator()\n"
        "print('mapped', allocator.SEARCH_DIRS[0] in open('/proc/self/maps').read())\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env["KVSERVE_PRELOAD_ALLOCATOR"] = "1"
    lines = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    starts = [line for line in lines if line.startswith("start")]
    assert len(starts) == 2 and starts[0] == starts[1]  # execv keeps the pid
    assert lines[-1] == "mapped True"
