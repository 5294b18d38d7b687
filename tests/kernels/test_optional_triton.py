"""The kernel package imports and runs its torch references without Triton installed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

# sys.modules[name] = None makes `import name` raise ImportError, as if not installed.
_SCRIPT = """
import sys
sys.modules["triton"] = None
sys.modules["triton.language"] = None
import torch
from kvserve import kernels
from kvserve.kernels import norm
from kvserve.kernels._triton import HAS_TRITON
assert not HAS_TRITON
x = torch.randn(3, 8)
out = kernels.rms_norm(x, torch.ones(8), 1e-6)
assert out.shape == (3, 8)
try:
    norm.rms_norm(x, torch.ones(8), 1e-6)
except RuntimeError as error:
    assert "pip install triton" in str(error)
else:
    raise AssertionError("the Triton wrapper ran without triton")
print("ok")
"""


def test_kernels_import_and_run_without_triton():
    result = subprocess.run(
        [sys.executable, "-c", _SCRIPT], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == "ok"
