"""Ending a kvserve process once it has shut its own parts down.

A normal Python exit then unloads every module, and torch's native teardown alone takes
0.9 s on a loaded 2-core machine (`import torch`, then exit: 0.88 s; with os._exit 0.03 s),
after torch.distributed was used sometimes seconds more (gloo, the c10d store). A stopping
server pays it in every process in turn (worker, engine core, api), and nobody waits for
anything it does. `exit_process` runs what a normal exit runs that matters, then ends the
process at once.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from typing import NoReturn

# How long the exit waits for non-daemon threads in all (a normal exit waits forever).
THREADS_JOIN_TIMEOUT_S = 5.0


def exit_process(code: int) -> NoReturn:
    """Exit with `code` without the interpreter's teardown.

    As a normal exit does: waits for the non-daemon threads (up to THREADS_JOIN_TIMEOUT_S
    in all, where a normal exit would wait forever), then runs the atexit handlers
    (logging's flush, multiprocessing's finalizers and the joins of its non-daemon
    children, exporters' flushes); then flushes stdout and stderr and calls os._exit.
    """
    current = threading.current_thread()
    deadline = time.monotonic() + THREADS_JOIN_TIMEOUT_S
    for thread in threading.enumerate():
        if thread is not current and not thread.daemon:
            thread.join(max(0.0, deadline - time.monotonic()))
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):  # closed or replaced by a test
            pass
    os._exit(code)
