"""Kernels: one dispatch point.

Each op has a torch reference (`*_ref`, used on CPU) and a Triton kernel (used on CUDA). Callers
import the op names below and never pick an implementation themselves.

This folder is the package `kvserve.kernels` (pyproject's package-dir). When a checkout's root is
on `sys.path` (`python -m ...` or pytest run from it), the folder is also importable as a
top-level `kernels`, which shadows PyPI's `kernels`: transformers >= 5.25 depends on that package
and probes for it. Imported under that name, this module hands the name to the installed
package; when none is installed it becomes what Python makes of a bare folder on the path, an
empty namespace package (no `__file__`, no names, no submodules), which probes such as
transformers' `is_kernels_available()` count as absent.
"""

import sys

if __name__ == "kernels":
    import importlib.machinery
    import importlib.util
    import os

    def _hand_over_the_name() -> None:
        checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        path = [p for p in sys.path if os.path.abspath(p or os.curdir) != checkout]
        spec = importlib.machinery.PathFinder.find_spec("kernels", path)
        if spec is None:
            # Nothing installed: an empty namespace package, as a folder without
            # __init__.py would be.
            spec = importlib.machinery.ModuleSpec("kernels", None, is_package=True)
            spec.submodule_search_locations = []
        module = importlib.util.module_from_spec(spec)
        sys.modules["kernels"] = module
        if spec.loader is not None:
            spec.loader.exec_module(module)

    _hand_over_the_name()
else:
    from kvserve.kernels.dispatch import (
        argmax,
        fused_add_rms_norm,
        linear,
        linear_fuses_add,
        paged_attention,
        rms_norm,
        rotary_embedding,
        rotary_write_kv_cache,
        silu_and_mul,
        write_kv_cache,
    )

    __all__ = [
        "argmax",
        "fused_add_rms_norm",
        "linear",
        "linear_fuses_add",
        "paged_attention",
        "rms_norm",
        "rotary_embedding",
        "rotary_write_kv_cache",
        "silu_and_mul",
        "write_kv_cache",
    ]
