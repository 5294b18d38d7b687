"""Run the Triton kernels through Triton's interpreter on CPU, compiled on a GPU.

Triton reads TRITON_INTERPRET when it is imported (its own `tl.sum`, `tl.max`, ... are jitted
then), so the variable is set here, at conftest import, before any kernel module imports
triton. Only without CUDA: with a GPU the same tests run the compiled kernels on CUDA tensors.
The variable stays set for the rest of a CPU-only session, which is harmless there: Triton
kernels only ever run on CUDA tensors outside these tests.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from kvserve.kernels._triton import HAS_TRITON, triton  # noqa: E402  (after TRITON_INTERPRET)


def _interpreter_active() -> bool:
    return type(triton.language.sum).__name__ == "InterpretedFunction"


@pytest.fixture
def triton_kernels() -> None:
    """Skip, with the reason, when the Triton kernels cannot run here."""
    if not HAS_TRITON:
        pytest.skip("triton is not installed (pip install triton): Triton kernel tests skipped")
    if not torch.cuda.is_available() and not _interpreter_active():
        pytest.skip(
            "triton was imported before TRITON_INTERPRET=1 was set; run "
            "`pytest tests/kernels` on its own or export TRITON_INTERPRET=1"
        )
