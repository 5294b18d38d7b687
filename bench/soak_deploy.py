"""The soak's deployment: `kvserve serve` as a user runs it, and its processes by role.

Two variants:

    dp  kvserve kv-store (its own process, started again by the soak when it dies, as its
        supervisor would) + kvserve serve --data-parallel-size 2 --restart-dead-engines
        --distributed-executor-backend mp --kv-transfer-config KvStoreConnector kv_both
    pd  kvserve serve --prefill-size 1 --decode-size 1 --restart-dead-engines
        --distributed-executor-backend mp (the launcher starts and supervises the store)

Both take API keys with tenants from a key file (`name:key weight=W`), which the chaos edits
and reloads with SIGHUP. The processes are found from the process tree, never from guesses
(`Deployment.roles`): the launcher is the api; its child running multiprocessing's
resource tracker is the api's helper; the engine cores are the pids /health names; their
spawned children are their workers; the KV store is the process bound to the store's
ipc:// socket (psutil's unix sockets); the DP coordinator is the child bound to
ipc://.../stats (CoordinatorAddresses.local).
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field

import httpx
import psutil

from tests.support.http import http_get
from tests.support.ports import free_port
from tests.support.server import ServeProcess, wait_healthy
from tests.support.waiting import wait_until

SERVED_MODEL = "soak"
TENANT_KEYS = {"alice": "sk-soak-alice", "bob": "sk-soak-bob"}
ROLES = ("api", "api_helper", "engine", "worker", "kv_store", "coordinator", "other")
# A chat template for the tiny byte-level model, which ships none.
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
# torch keeps oneDNN primitives per input shape in two LRU caches of 1024 entries: batches of
# every size fill them with ~150 MiB, which would hide (or fake) a leak (tests/faults/
# test_load_held.py). Small caches keep RSS flat unless something really grows.
BOUNDED_CACHES_ENV = {"LRU_CACHE_CAPACITY": "16", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "16"}
# The engines skip the start-up timings of the decode stack and the prefill route (as the
# suite's engines do, tests/conftest.py): on a loaded 2-core machine (load average ~20) they
# took minutes of each start and of every restart the chaos causes. The tiny model's skip the
# GEMM plan's too (the default model's plan is cached on this machine).
FAST_START_ENV = {"KVSERVE_NATIVE_DECODE_MEASURE": "0", "KVSERVE_PREFILL_ROUTE_MEASURE": "0"}
TINY_ENV = {**FAST_START_ENV, "KVSERVE_CPU_GEMM_MEASURE": "0"}
# A start on that machine: the default model's engines took over 300 s with the timings.
START_TIMEOUT_S = 900.0


@dataclass
class DeploymentSpec:
    """What to deploy.

    Args:
        variant: "dp" (DP=2 beside a KV store) or "pd" (one prefill, one decode engine).
        model: a model folder or GGUF (None: the embedded default model).
        tiny: the model is tests/support/models.py's tiny Llama (a chat template is added).
        folder: where logs, the key file and the store's socket go.
        kv_cache_memory: each engine's KV cache bytes (--kv-cache-memory).
        max_model_len: --max-model-len (None: the model's).
    """

    variant: str
    model: str | None
    tiny: bool
    folder: str
    kv_cache_memory: str = "256M"
    max_model_len: int | None = 1024


@dataclass
class Deployment:
    """A started deployment: the launcher (`front`), the dp variant's own store, the key
    file. Args: spec: what to deploy."""

    spec: DeploymentSpec
    front: ServeProcess | None = None
    store: subprocess.Popen | None = None
    store_restarts: int = 0
    key_file: str = ""
    key_edits: int = 0
    stopped_pids: set[int] = field(default_factory=set)

    @property
    def store_address(self) -> str:
        return "ipc://" + os.path.join(self.spec.folder, "kv-store.sock")

    @property
    def url(self) -> str:
        assert self.front is not None
        return self.front.url

    def start(self) -> None:
        """The store (dp), then `kvserve serve`, healthy."""
        self.key_file = os.path.join(self.spec.folder, "keys.txt")
        self.write_key_file()
        if self.spec.variant == "dp":
            self.start_store()
        port = free_port()
        self.front = ServeProcess(
            self.serve_flags(port),
            os.path.join(self.spec.folder, "serve.log"),
            port,
            served_model_name=SERVED_MODEL,
            env={**BOUNDED_CACHES_ENV, **(TINY_ENV if self.spec.tiny else FAST_START_ENV)},
        )
        wait_healthy(self.front.process, port, self.front.log_path, timeout_s=START_TIMEOUT_S)

    def serve_flags(self, port: int) -> list[str]:
        spec = self.spec
        flags = [spec.model] if spec.model else []
        flags += ["--host", "127.0.0.1", "--port", str(port)]
        flags += ["--served-model-name", SERVED_MODEL, "--kv-cache-memory", spec.kv_cache_memory]
        flags += ["--api-key-file", self.key_file, "--uvicorn-log-level", "warning"]
        flags += ["--restart-dead-engines", "--distributed-executor-backend", "mp"]
        if spec.max_model_len:
            flags += ["--max-model-len", str(spec.max_model_len)]
        if spec.tiny:
            template = os.path.join(spec.folder, "chat.jinja")
            with open(template, "w") as f:
                f.write(TINY_CHAT_TEMPLATE)
            flags += ["--chat-template", template]
        if spec.variant == "pd":
            return flags + ["--prefill-size", "1", "--decode-size", "1", "--kv-store-size", "256M"]
        transfer = {
            "kv_connector": "KvStoreConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"store_address": self.store_address},
        }
        return flags + ["--data-parallel-size", "2", "--kv-transfer-config", json.dumps(transfer)]

    # ------------------------------------------------------------------ the KV store (dp)

    def start_store(self) -> None:
        """`kvserve kv-store` on the store address, listening; a dead one's shared memory
        (named after its pid; a killed store cannot unlink it) is removed first."""
        if self.store is not None:
            for path in glob.glob(f"/dev/shm/kvserve-kv-*-{self.store.pid}"):
                os.unlink(path)
        socket_path = self.store_address.removeprefix("ipc://")
        if os.path.exists(socket_path):
            os.unlink(socket_path)
        log = open(os.path.join(self.spec.folder, "kv-store.log"), "a")
        command = [sys.executable, "-m", "kvserve.cli", "kv-store"]
        command += ["--address", self.store_address, "--size", "256M"]
        self.store = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        assert wait_until(lambda: os.path.exists(socket_path), timeout_s=60), "store not bound"

    def restart_store_if_dead(self) -> bool:
        """The dp variant's store supervisor: start it again if it died; True if it did."""
        if self.store is None or self.store.poll() is None:
            return False
        self.store_restarts += 1
        self.start_store()
        return True

    # ------------------------------------------------------------------ the key file

    def write_key_file(self) -> None:
        """alice (weight 2) and bob; each edit turns bob's weight and adds or drops a key
        no client uses, so a reload changes something without revoking a key in use."""
        lines = [f"alice:{TENANT_KEYS['alice']} weight=2"]
        lines.append(f"bob:{TENANT_KEYS['bob']} weight={1 + self.key_edits % 2}")
        if self.key_edits % 2:
            lines.append(f"rotated:sk-soak-rotated-{self.key_edits} max_concurrent=4")
        with open(self.key_file + ".tmp", "w") as f:
            f.write("\n".join(lines) + "\n")
        os.replace(self.key_file + ".tmp", self.key_file)

    def edit_key_file(self) -> None:
        self.key_edits += 1
        self.write_key_file()

    # ------------------------------------------------------------------ processes by role

    def health(self) -> dict:
        try:
            return http_get(self.url + "/health", timeout=5).json()
        except (httpx.HTTPError, ValueError):
            return {}

    def roles(self) -> dict[str, list[psutil.Process]]:
        """Every live process of the deployment, by role (ROLES)."""
        found: dict[str, list[psutil.Process]] = {role: [] for role in ROLES}
        assert self.front is not None
        try:
            launcher = psutil.Process(self.front.process.pid)
            children = launcher.children()
        except psutil.NoSuchProcess:
            return found
        found["api"] = [launcher]
        engine_pids = {entry["pid"] for entry in self.health().get("engines", [])}
        store_path = self.store_address.removeprefix("ipc://")
        if self.spec.variant == "pd":
            store_path = self.health().get("kv_store", "").removeprefix("ipc://")
        for child in _with_own_store(children, self.store):
            found[_role(child, engine_pids, store_path)].append(child)
        for engine in found["engine"]:
            found["worker"] += _spawned_children(engine)
        return found


def _with_own_store(
    children: list[psutil.Process], store: subprocess.Popen | None
) -> list[psutil.Process]:
    if store is None or store.poll() is not None:
        return children
    try:
        return [*children, psutil.Process(store.pid)]
    except psutil.NoSuchProcess:
        return children


def _role(process: psutil.Process, engine_pids: set[int], store_path: str) -> str:
    """A launcher child's role (or the dp variant's store)."""
    try:
        cmdline = " ".join(process.cmdline())
        if "resource_tracker" in cmdline:
            return "api_helper"
        if process.pid in engine_pids:
            return "engine"
        bound = {c.laddr for c in process.net_connections("unix")}
        if "kv-store" in cmdline or (store_path and store_path in bound):
            return "kv_store"
        # The coordinator binds ipc://FOLDER/stats and ipc://FOLDER/load (CoordinatorAddresses).
        if any(path.endswith("/stats") for path in bound):
            return "coordinator"
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        pass
    return "other"  # an engine core not ready yet, or a short-lived helper


def _spawned_children(process: psutil.Process) -> list[psutil.Process]:
    try:
        return [c for c in process.children() if "spawn_main" in " ".join(c.cmdline())]
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return []
