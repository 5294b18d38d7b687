"""One logger setup for every process: one line per event, with the process kind."""

from __future__ import annotations

import logging
import os
import sys

_FORMAT = "%(levelname)s %(asctime)s.%(msecs)03d [%(process)d %(name)s] %(message)s"
_configured = False


def init_logger(name: str) -> logging.Logger:
    """A logger under the `kvserve` root, configured once from KVSERVE_LOG_LEVEL."""
    global _configured
    if not _configured:
        root = logging.getLogger("kvserve")
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%H:%M:%S"))
        root.addHandler(handler)
        root.setLevel(os.environ.get("KVSERVE_LOG_LEVEL", "INFO").upper())
        root.propagate = False
        _configured = True
    return logging.getLogger(name if name.startswith("kvserve") else f"kvserve.{name}")
