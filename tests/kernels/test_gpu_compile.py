"""Every Triton kernel compiles to a Hopper cubin (see gpu_compile.py), even without a GPU."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvserve.kernels._triton import HAS_TRITON
from tests.support import REPO_ROOT


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (pip install triton)")
def test_triton_kernels_compile_for_sm90():
    # A fresh process: this one imported triton in interpreter mode (conftest.py).
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    result = subprocess.run(
        [sys.executable, "-m", "tests.kernels.gpu_compile"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "10 kernels compiled" in result.stdout, result.stdout
