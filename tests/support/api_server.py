"""A real uvicorn server on 127.0.0.1 in a background thread, for the HTTP API tests.

The engine behind the shared server is a real EngineCore with the default model, run in this
process by InprocEngineClient. The modules that use it (`SHARED_SERVER_MODULES`) run back to
back on one pytest-xdist worker (tests/conftest.py); it is built on first use
(`shared_api_server`) and stopped after the last of them (`release_shared_api_server`), so
its ~1.3 GiB is held for those modules only.
"""

from __future__ import annotations

import atexit
import socket
import threading
import time

import uvicorn

from kvserve.shared.config import CacheConfig, EngineConfig, ModelConfig

SERVED_MODEL_NAME = "smollm2-test"
MAX_MODEL_LEN = 512
# The test modules that read from the shared server (paths as in pytest's node ids).
SHARED_SERVER_MODULES = ("tests/e2e/test_api_errors.py", "tests/e2e/test_openai_api.py")


def uses_shared_server(nodeid: str) -> bool:
    """Whether the test with this node id runs against the shared server."""
    return nodeid.split("::", 1)[0] in SHARED_SERVER_MODULES


class ServerThread:
    """Runs an ASGI app under uvicorn on a free port of 127.0.0.1.

    The socket is bound here (port 0: the kernel picks a free one) and handed to uvicorn, so
    no other process can take the port in between.

    Args:
        app: the ASGI app.
    """

    def __init__(self, app):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        config = uvicorn.Config(
            app, log_level="warning", lifespan="off", timeout_graceful_shutdown=2
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run,
            kwargs={"sockets": [self.sock]},
            name=f"uvicorn-{self.port}",
            daemon=True,
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 30.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


_shared: tuple | None = None
_lock = threading.Lock()


def shared_api_server():
    """(InprocEngineClient, ServerThread) over the default model, built on first use."""
    global _shared
    with _lock:
        if _shared is None:
            from kvserve.services.api.server import build_app
            from tests.support.inproc_client import InprocEngineClient

            config = EngineConfig(
                model=ModelConfig(max_model_len=MAX_MODEL_LEN, served_model_name=SERVED_MODEL_NAME),
                cache=CacheConfig(kv_cache_memory_bytes=256 << 20),
            )
            client = InprocEngineClient(config)
            server = ServerThread(build_app(client, served_model_name=SERVED_MODEL_NAME))
            server.start()
            _shared = (client, server)
            atexit.register(release_shared_api_server)
        return _shared


def release_shared_api_server() -> None:
    """Stop the shared server and free its engine, if it runs (safe to call twice)."""
    global _shared
    with _lock:
        if _shared is None:
            return
        client, server = _shared
        _shared = None
        server.stop()
        client.close()
