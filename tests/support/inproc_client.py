"""InprocEngineClient: a real EngineCore in a background thread of the api process.

For the fast HTTP tests only (like vLLM's InprocClient), which is why it lives in tests/: the
api process then holds the model, so this module imports torch lazily, inside the
constructor (test_protocol.py checks that importing it does not).

    event loop (api)                         engine thread
    generate() -> _send_requests --("add")--> commands --> add_request / abort_requests
                  _send_abort ---("abort")--> (a queue.Queue; blocks while idle)
                                                  | step() while the core has work
    _handle_outputs <-- outputs (asyncio.Queue) <-+ loop.call_soon_threadsafe
"""

from __future__ import annotations

import asyncio
import queue
import threading

from kvserve.services.api.engine_client.client import EngineClient
from kvserve.services.api.serving.tokenizer import TokenizerInfo
from kvserve.shared.config import EngineConfig
from kvserve.shared.logging import init_logger
from kvserve.shared.messages import EngineCoreOutputs, EngineCoreRequest
from kvserve.shared.wire import EngineReady

logger = init_logger(__name__)

_ADD, _ABORT, _STOP = "add", "abort", "stop"


class InprocEngineClient(EngineClient):
    """An EngineClient whose EngineCore runs in a thread of this process.

    Args:
        config: the engine config (default: the embedded model, default knobs).
        model_dir: a resolved model folder (default: resolved from config.model.model).
    """

    def __init__(self, config: EngineConfig | None = None, model_dir: str | None = None):
        from kvserve.services.scheduler.engine.engine_core import EngineCore  # torch: only here
        from kvserve.services.worker.model_loader import resolve_model

        config = config if config is not None else EngineConfig()
        model_dir = model_dir or resolve_model(config.model.model)
        self.engine_core = EngineCore(config, model_dir)
        model_name = config.model.served_name
        super().__init__(
            TokenizerInfo(config.model.tokenizer or model_dir, plain=True),  # as the api's
            self.engine_core.ready.max_model_len,
            model_name,
            max_logprobs=self.engine_core.ready.max_logprobs,
            max_waiting_requests=self.engine_core.ready.max_waiting_requests,
        )
        self._commands: queue.Queue = queue.Queue()
        # Bound on first use: the loop whose generate() calls receive the outputs.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._outputs: asyncio.Queue | None = None
        self._output_task: asyncio.Task | None = None
        self._thread = threading.Thread(
            target=self._run_engine, name="kvserve-inproc-engine", daemon=True
        )
        self._thread.start()

    def engine_handshakes(self) -> list[EngineReady]:
        return [self.engine_core.ready]

    # ------------------------------------------------------------------ event-loop side

    def _bind_loop(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop, self._outputs = loop, asyncio.Queue()
            self._output_task = loop.create_task(self._process_outputs())
        elif loop is not self._loop:
            raise RuntimeError(
                "InprocEngineClient serves one event loop; it is bound to another one already"
            )

    async def _send_requests(self, requests: list[EngineCoreRequest]) -> None:
        self._bind_loop()
        self._commands.put((_ADD, requests))

    async def _send_abort(self, engine_request_ids: list[str]) -> None:
        self._commands.put((_ABORT, engine_request_ids))

    async def _process_outputs(self) -> None:
        """One consumer keeps the engine's outputs in step order."""
        while True:
            outputs = await self._outputs.get()
            try:
                await self._handle_outputs(outputs)
            except Exception as exc:  # noqa: BLE001 - fail the requests, not the loop
                logger.exception("processing engine outputs failed")
                self._fail_all(f"processing engine outputs failed: {exc!r}")

    async def shutdown(self) -> None:
        await asyncio.to_thread(self.close)
        if self._output_task is not None:
            self._output_task.cancel()

    def close(self) -> None:
        """Stop the engine thread and free the engine (blocking; safe to call twice)."""
        if self._thread.is_alive():
            self._commands.put((_STOP, None))
            self._thread.join()
            self.engine_core.shutdown()

    # ------------------------------------------------------------------ engine thread

    def _run_engine(self) -> None:
        core = self.engine_core
        try:
            while True:
                # Block while the core has nothing to do; never spin.
                commands = [] if core.has_work() else [self._commands.get()]
                commands += self._drain_commands()
                if not self._apply(commands):
                    return
                if core.has_work():
                    self._deliver(core.step())
        except BaseException as exc:  # noqa: BLE001 - reported to every waiting request
            logger.exception("in-process engine core died")
            reason = f"engine core failed: {exc!r}"
            if not self._call_in_loop(self._fail_all, reason):
                self.dead_reason = reason

    def _drain_commands(self) -> list:
        commands = []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _apply(self, commands: list) -> bool:
        """Apply queued commands in order; False when told to stop."""
        for kind, payload in commands:
            if kind == _ADD:
                for request in payload:
                    self.engine_core.add_request(request)
            elif kind == _ABORT:
                # Aborted requests free their blocks now; the next step reports the new load.
                self.engine_core.abort_requests(payload)
            else:
                assert kind == _STOP, kind
                return False
        return True

    def _deliver(self, outputs: EngineCoreOutputs) -> None:
        assert self._loop is not None, "outputs before any request was sent"
        self._call_in_loop(self._outputs.put_nowait, outputs)

    def _call_in_loop(self, callback, *args) -> bool:
        """Run callback(*args) on the bound loop; False when there is no live loop."""
        if self._loop is None:
            return False
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the loop was closed: nobody is waiting any more
            return False
        return True
