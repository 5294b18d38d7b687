"""docker/kubernetes/: compose.yaml's stack as Kubernetes manifests, checked against
compose.yaml and the code.

`manifest_problems` reads the folder (kustomization.yaml's resources and Secrets) and names
every field that disagrees with compose.yaml or kvserve: the image, each container's command
(compose's, word for word, parsed by kvserve's own CLI), the ports the Services and probes
reach, the /health probes, the Secrets mounted where --api-key-file and --transport-keys
point, the model cache and /dev/shm mounts, the PodMonitor's selector and port. The same
check run on mutated copies must name the mutation (it can fail). `kubectl kustomize`
(Debian's kubectl) renders the folder with its Secrets, and kubernetes-validate (the `test`
extra, Kubernetes' JSON schemas bundled) checks the rendered objects. Two commands of the
manifests run here as the pods would run them: the init container's key copy (on a folder laid
out as a Secret volume) and the engines' readiness probe (against an api /health body).
"""

from __future__ import annotations

import base64
import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvserve.cli import parse_options
from kvserve.shared.transport_security import generate_keys, key_files, load_keys
from tests.support import REPO_ROOT

MANIFESTS = REPO_ROOT / "docker" / "kubernetes"
# compose service -> (kind, name) of the Kubernetes workload that runs it.
WORKLOADS = {
    "api": ("Deployment", "api"),
    "coordinator": ("Deployment", "coordinator"),
    "engine": ("StatefulSet", "engine"),  # compose's engine-0, engine-1, ...
}
CLIENT_SERVICE = "kvserve"  # the api's port for clients; compose's `api` name is the engines'
ENGINE_INDEX = "$(ENGINE_INDEX)"
POD_INDEX_FIELD = "metadata.labels['apps.kubernetes.io/pod-index']"
_SIZE_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "ki": 2**10, "mi": 2**20, "gi": 2**30}


def _bytes(size: str) -> int:
    """A compose (1gb) or Kubernetes (1Gi) size in bytes; both are binary."""
    match = re.fullmatch(r"(\d+)\s*([a-zA-Z]*?)b?", str(size))
    assert match is not None, f"not a size: {size!r}"
    number, unit = match.groups()
    return int(number) * _SIZE_UNITS[unit.lower()]


def _flag(command: list[str], name: str) -> str | None:
    """The value after `name` in a command, None when absent."""
    return command[command.index(name) + 1] if name in command else None


def _load_folder(folder: Path) -> tuple[dict, list[dict]]:
    kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
    docs: list[dict] = []
    for resource in kustomization["resources"]:
        docs.extend(d for d in yaml.safe_load_all((folder / resource).read_text()) if d)
    return kustomization, docs


def _find(docs: list[dict], kind: str, name: str) -> dict | None:
    return next((d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name), None)


def _container_port(container: dict, port: int | str) -> int | None:
    """The container port a Service targetPort or probe port (number or name) reaches."""
    for entry in container.get("ports", []):
        if port in (entry["containerPort"], entry.get("name")):
            return int(entry["containerPort"])
    return None


def _mount(container: dict, path: str) -> dict | None:
    return next((m for m in container.get("volumeMounts", []) if m["mountPath"] == path), None)


def _volume(pod: dict, name: str) -> dict | None:
    return next((v for v in pod.get("volumes", []) if v["name"] == name), None)


@dataclass(frozen=True)
class _Expected:
    """What compose.yaml (and the kustomization's Secrets) ask of every workload."""

    image_name: str
    environment: dict[str, str]
    cache_mount: str
    keys_mount: str
    shm_size: str
    dp_size: int
    commands: dict[str, list[list[str]]]  # compose service -> each pod's command
    generated: dict[str, list[str]]  # Secret name -> its file names


def _expected(compose: dict, kustomization: dict, dp_size: int) -> _Expected:
    shared, services = compose["x-kvserve"], compose["services"]
    mounts = dict(v.split(":")[:2] for v in shared["volumes"])
    engines = [f"engine-{i}" for i in range(dp_size)]
    return _Expected(
        image_name=shared["image"].split(":")[0],
        environment=shared["environment"],
        cache_mount=mounts["kvserve-cache"],
        keys_mount=mounts["kvserve-keys"],
        shm_size=services["engine-0"]["shm_size"],
        dp_size=dp_size,
        commands={
            "api": [services["api"]["command"]],
            "coordinator": [services["coordinator"]["command"]],
            "engine": [services[e]["command"] for e in engines if e in services],
        },
        generated={
            g["name"]: [Path(f).name for f in g["files"]] for g in kustomization["secretGenerator"]
        },
    )


def manifest_problems(folder: Path, compose: dict) -> list[str]:
    """Every disagreement between the manifests in `folder` and compose.yaml / kvserve."""
    problems: list[str] = []
    kustomization, docs = _load_folder(folder)
    listed = set(kustomization["resources"])
    on_disk = {p.name for p in folder.glob("*.yaml")} - {"kustomization.yaml"}
    if listed != on_disk:
        problems.append(f"kustomization resources {sorted(listed)} != files {sorted(on_disk)}")
    api_workload = _find(docs, *WORKLOADS["api"])
    engine_workload = _find(docs, *WORKLOADS["engine"])
    if api_workload is None or engine_workload is None:
        return [*problems, "the api Deployment or the engine StatefulSet is missing"]
    api_command = api_workload["spec"]["template"]["spec"]["containers"][0]["command"]
    dp_size = int(_flag(api_command, "--data-parallel-size") or 1)
    if engine_workload["spec"]["replicas"] != dp_size:
        problems.append(
            f"engine replicas {engine_workload['spec']['replicas']} != the api's "
            f"--data-parallel-size {dp_size}"
        )
    expected = _expected(compose, kustomization, dp_size)
    if [i["name"] for i in kustomization.get("images", [])] != [expected.image_name]:
        problems.append(f"kustomization images do not name compose's image {expected.image_name!r}")

    binders: dict[int, tuple[dict, dict]] = {}  # a tcp://*:PORT bound -> (pod template, container)
    for service_name, (kind, name) in WORKLOADS.items():
        workload = _find(docs, kind, name)
        if workload is None:
            problems.append(f"no {kind} {name} for compose's {service_name}")
            continue
        problems += _workload_problems(service_name, workload, expected)
        template = workload["spec"]["template"]
        container = template["spec"]["containers"][0]
        for word in container["command"]:
            if word.startswith("tcp://*:"):
                binders[int(word.rsplit(":", 1)[1])] = (template, container)
    problems += _api_http_problems(compose, docs, api_workload)
    problems += _address_problems(docs, binders)
    return problems


def _workload_problems(service_name: str, workload: dict, expected: _Expected) -> list[str]:
    """One workload against compose's service: labels, image, env, command, volumes."""
    problems: list[str] = []
    name = workload["metadata"]["name"]
    template = workload["spec"]["template"]
    if template["metadata"]["labels"] != workload["spec"]["selector"]["matchLabels"]:
        problems.append(f"{name}: its selector is not its pod labels")
    pod = template["spec"]
    container = pod["containers"][0]
    for each in [*pod.get("initContainers", []), *pod["containers"]]:
        if each["image"].split(":")[0] != expected.image_name:
            problems.append(
                f"{name}/{each['name']}: image {each['image']!r} is not {expected.image_name!r}"
            )
    command = container["command"]
    env = {e["name"]: e for e in container.get("env", [])}
    for compose_env, value in expected.environment.items():
        if env.get(compose_env, {}).get("value") != value:
            problems.append(f"{name}: env {compose_env} is not compose's {value!r}")

    # The command: compose's, the engines' with their pod index as --engine-index, the api's
    # with --api-key-file added; each parsed by kvserve's CLI as the pod runs it.
    pods = [command]
    if ENGINE_INDEX in command:
        index_field = env.get("ENGINE_INDEX", {}).get("valueFrom", {}).get("fieldRef", {})
        if index_field.get("fieldPath") != POD_INDEX_FIELD:
            problems.append(f"{name}: ENGINE_INDEX is not the pod's index")
        pods = [
            [str(i) if w == ENGINE_INDEX else w for w in command] for i in range(expected.dp_size)
        ]
    for argv in pods:
        try:
            parse_options(argv[1:])
        except SystemExit:
            problems.append(f"{name}: kvserve refuses the command {argv}")
    key_file = _flag(command, "--api-key-file")
    if service_name == "api" and key_file is None:
        problems.append("api: no --api-key-file")
    elif key_file is not None:
        problems += _secret_file_problems(pod, container, key_file, expected.generated)
        at = command.index("--api-key-file")
        pods = [command[:at] + command[at + 2 :]]
    if pods != expected.commands[service_name]:
        problems.append(
            f"{name}: command {pods} is not compose's {expected.commands[service_name]}"
        )

    # Volumes: the model cache, the transport keys (a Secret copied by the init container).
    if _mount(container, expected.cache_mount) is None:
        problems.append(f"{name}: nothing mounted at compose's model cache {expected.cache_mount}")
    keys_dir = _flag(command, "--transport-keys")
    keys = _mount(container, expected.keys_mount)
    if keys_dir != expected.keys_mount or keys is None or not keys.get("readOnly"):
        problems.append(
            f"{name}: --transport-keys {keys_dir} is not a read-only mount at {expected.keys_mount}"
        )
    else:
        problems += _transport_key_problems(
            pod, keys["name"], expected.keys_mount, expected.generated
        )
    if service_name == "engine":
        shm = _mount(container, "/dev/shm")
        volume = (_volume(pod, shm["name"]) if shm else None) or {}
        memory = volume.get("emptyDir", {})
        if memory.get("medium") != "Memory" or _bytes(memory.get("sizeLimit", "0")) < _bytes(
            expected.shm_size
        ):
            problems.append(
                f"{name}: /dev/shm is not a memory emptyDir of compose's shm_size "
                f"{expected.shm_size}"
            )
    if not container.get("resources", {}).get("requests"):
        problems.append(f"{name}: no resource requests")
    return problems


def _secret_file_problems(pod: dict, container: dict, path: str, generated: dict) -> list[str]:
    folder, file_name = path.rsplit("/", 1)
    mount = _mount(container, folder)
    volume = _volume(pod, mount["name"]) if mount else None
    secret = (volume or {}).get("secret", {}).get("secretName")
    if mount is None or secret not in generated or file_name not in generated[secret]:
        return [f"api: --api-key-file {path} is not a file of a generated Secret at {folder}"]
    if mount.get("subPath"):
        return [f"api: --api-key-file {path} is a subPath mount: it never sees the Secret's edits"]
    return []


def _transport_key_problems(
    pod: dict, volume_name: str, keys_mount: str, generated: dict
) -> list[str]:
    """The keys folder: filled by an init container from a generated Secret holding the files
    `kvserve keys generate` writes."""
    key_names = [Path(f).name for f in key_files(keys_mount)]
    for init in pod.get("initContainers", []):
        into = next((m for m in init.get("volumeMounts", []) if m["name"] == volume_name), None)
        for mount in init.get("volumeMounts", []):
            secret = (_volume(pod, mount["name"]) or {}).get("secret", {}).get("secretName")
            script = " ".join(init["command"])
            if (
                into
                and into["mountPath"] == keys_mount
                and secret in generated
                and sorted(generated[secret]) == sorted(key_names)
                and all(f"{mount['mountPath']}/{k}" in script for k in key_names)
                and f"chmod 0600 {keys_mount}/" in script
            ):
                return []
    return [
        f"{keys_mount}: not filled from a Secret of {key_names} (owner-only) by an init container"
    ]


def _api_http_problems(compose: dict, docs: list[dict], api_workload: dict) -> list[str]:
    problems: list[str] = []
    compose_api = compose["services"]["api"]
    port = int(_flag(compose_api["command"], "--port") or 0)
    pod = api_workload["spec"]["template"]
    container = pod["spec"]["containers"][0]
    if _container_port(container, "http") != port:
        problems.append(f"api: container port http is not --port {port}")
    service = _find(docs, "Service", CLIENT_SERVICE)
    if service is None or service["spec"].get("publishNotReadyAddresses"):
        problems.append(
            f"Service {CLIENT_SERVICE}: missing, or it sends clients to an api not ready"
        )
    http = next(
        (p for p in (service or {}).get("spec", {}).get("ports", []) if p["name"] == "http"), None
    )
    if http is None or _container_port(container, http["targetPort"]) != port:
        problems.append(
            f"Service {CLIENT_SERVICE}: http's targetPort does not reach the api's port {port}"
        )
    start_period = int(compose_api["healthcheck"]["start_period"].rstrip("s"))
    for probe_name in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = container.get(probe_name, {})
        get = probe.get("httpGet", {})
        if get.get("path") != "/health" or _container_port(container, get.get("port", -1)) != port:
            problems.append(f"api: {probe_name} does not GET /health on port {port}")
        elif (
            probe_name != "readinessProbe"
            and probe.get("periodSeconds", 10) * probe.get("failureThreshold", 3) < start_period
        ):
            problems.append(
                f"api: {probe_name} gives up before compose's start_period {start_period}s"
            )
    monitor = _find(docs, "PodMonitor", "kvserve-api")
    if monitor is None:
        return [*problems, "no PodMonitor kvserve-api"]
    selector = monitor["spec"]["selector"]["matchLabels"]
    if not selector.items() <= pod["metadata"]["labels"].items() or any(
        selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()
        for d in docs
        if d.get("spec", {}).get("template") and d is not api_workload
    ):
        problems.append("PodMonitor: its selector does not pick the api pods alone")
    endpoints = monitor["spec"]["podMetricsEndpoints"]
    if [(e["port"], e["path"]) for e in endpoints] != [("http", "/metrics")]:
        problems.append("PodMonitor: does not scrape /metrics on the api's http port")
    return problems


def _address_problems(docs: list[dict], binders: dict[int, tuple[dict, dict]]) -> list[str]:
    """Every tcp://HOST:PORT a command connects to is a Service on PORT whose pods bind it."""
    problems: list[str] = []
    for doc in docs:
        template = doc.get("spec", {}).get("template")
        if not template:
            continue
        for word in template["spec"]["containers"][0]["command"]:
            match = re.fullmatch(r"tcp://([a-z0-9-]+):(\d+)", word)
            if not match:
                continue
            host, port = match[1], int(match[2])
            service = _find(docs, "Service", host)
            entry = next(
                (p for p in (service or {}).get("spec", {}).get("ports", []) if p["port"] == port),
                None,
            )
            bound = binders.get(port)
            if service is None or entry is None or bound is None:
                problems.append(
                    f"{word}: no Service {host} on port {port} before a socket bound there"
                )
                continue
            # The api turns ready only after its engines' READY: its sockets are published
            # before (its readiness would wait for the engines, theirs for its sockets).
            if host == "api" and not service["spec"].get("publishNotReadyAddresses"):
                problems.append(f"{word}: Service {host} hides the api's sockets until it is ready")
            selected = service["spec"]["selector"].items() <= bound[0]["metadata"]["labels"].items()
            if not selected or _container_port(bound[1], entry["targetPort"]) != port:
                problems.append(f"{word}: Service {host} does not reach the pod that binds {port}")
    return problems


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((REPO_ROOT / "compose.yaml").read_text())


def test_manifests_agree_with_compose_and_kvserve(compose):
    assert manifest_problems(MANIFESTS, compose) == []


def _edit(file: str, change: Callable[[list[dict]], None]) -> Callable[[Path], None]:
    def apply(folder: Path) -> None:
        docs = [d for d in yaml.safe_load_all((folder / file).read_text()) if d]
        change(docs)
        (folder / file).write_text(yaml.safe_dump_all(docs))

    return apply


def _container(docs: list[dict], kind: str) -> dict:
    return next(d for d in docs if d["kind"] == kind)["spec"]["template"]["spec"]["containers"][0]


def _set_port(docs: list[dict]) -> None:
    _container(docs, "Deployment")["ports"][0]["containerPort"] = 8080


def _set_probe_path(docs: list[dict]) -> None:
    _container(docs, "Deployment")["readinessProbe"]["httpGet"]["path"] = "/healthz"


def _set_engine_arg(docs: list[dict]) -> None:
    command = _container(docs, "StatefulSet")["command"]
    command[command.index("--kv-cache-memory") + 1] = "2GiB"


def _set_key_mount(docs: list[dict]) -> None:
    _container(docs, "Deployment")["volumeMounts"][2]["mountPath"] = "/etc/keys"


def _set_image(docs: list[dict]) -> None:
    _container(docs, "StatefulSet")["image"] = "vllm/vllm-openai:latest"


def _set_cache_mount(docs: list[dict]) -> None:
    _container(docs, "StatefulSet")["volumeMounts"][0]["mountPath"] = "/models"


def _set_target_port(docs: list[dict]) -> None:
    next(d for d in docs if d["kind"] == "Service")["spec"]["ports"][0]["targetPort"] = 8080


def _drop_publish_not_ready(docs: list[dict]) -> None:
    api = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == "api")
    api["spec"].pop("publishNotReadyAddresses")


def _misspell_flag(docs: list[dict]) -> None:
    command = _container(docs, "Deployment")["command"]
    command[command.index("--served-model-name")] = "--model-served-name"


def _set_index_field(docs: list[dict]) -> None:
    env = _container(docs, "StatefulSet")["env"][1]
    env["valueFrom"]["fieldRef"]["fieldPath"] = "metadata.name"


def _set_replicas(docs: list[dict]) -> None:
    next(d for d in docs if d["kind"] == "StatefulSet")["spec"]["replicas"] = 3


def _set_monitor_port(docs: list[dict]) -> None:
    docs[0]["spec"]["podMetricsEndpoints"][0]["port"] = "metrics"


def _set_service_host(docs: list[dict]) -> None:
    next(d for d in docs if d["kind"] == "Service")["metadata"]["name"] = "kvserve-coordinator"


def _drop_chmod(docs: list[dict]) -> None:
    init = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"][
        "initContainers"
    ][0]
    init["command"][-1] = init["command"][-1].split(" && ")[0]


MUTATIONS = {
    "api port": (_edit("api.yaml", _set_port), "container port http is not --port 8000"),
    "probe path": (_edit("api.yaml", _set_probe_path), "readinessProbe does not GET /health"),
    "engine arg": (_edit("engine.yaml", _set_engine_arg), "engine: command"),
    "key file mount": (_edit("api.yaml", _set_key_mount), "--api-key-file"),
    "image": (_edit("engine.yaml", _set_image), "image 'vllm/vllm-openai:latest'"),
    "cache mount": (_edit("engine.yaml", _set_cache_mount), "compose's model cache /cache"),
    "target port": (_edit("api.yaml", _set_target_port), "http's targetPort"),
    "engine sockets hidden": (
        _edit("api.yaml", _drop_publish_not_ready),
        "hides the api's sockets until it is ready",
    ),
    "misspelt flag": (_edit("api.yaml", _misspell_flag), "kvserve refuses the command"),
    "engine index": (_edit("engine.yaml", _set_index_field), "ENGINE_INDEX is not the pod's"),
    "replicas": (_edit("engine.yaml", _set_replicas), "--data-parallel-size 2"),
    "monitor port": (_edit("podmonitor.yaml", _set_monitor_port), "PodMonitor: does not scrape"),
    "service name": (_edit("coordinator.yaml", _set_service_host), "no Service coordinator"),
    "key mode": (_edit("api.yaml", _drop_chmod), "owner-only"),
}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_a_mutated_copy_is_named(compose, tmp_path, mutation):
    folder = tmp_path / "kubernetes"
    shutil.copytree(MANIFESTS, folder)
    mutate, expected = MUTATIONS[mutation]
    mutate(folder)
    problems = manifest_problems(folder, compose)
    assert any(expected in p for p in problems), problems


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> list[dict]:
    """`kubectl kustomize` of a copy of the folder with the Secrets' sources made as README
    says (a key file, `kvserve keys generate`)."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("Debian's kubectl is not installed (`make test` installs it)")
    folder = tmp_path_factory.mktemp("render") / "kubernetes"
    shutil.copytree(MANIFESTS, folder)
    (folder / "api-keys.txt").write_text(API_KEY_FILE)
    generate_keys(str(folder / "transport-keys"))
    out = subprocess.run(
        [kubectl, "kustomize", str(folder)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


API_KEY_FILE = "default:sk-render-test\nbatch:sk-batch max_concurrent=4\n"


def test_kustomize_renders_the_folder_with_its_secrets(rendered):
    _, source = _load_folder(MANIFESTS)
    for doc in rendered:
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == "kvserve", doc["metadata"]
        assert doc["metadata"]["labels"]["app.kubernetes.io/name"] == "kvserve"
    secrets = {d["metadata"]["name"]: d["data"] for d in rendered if d["kind"] == "Secret"}
    assert base64.b64decode(secrets["kvserve-api-keys"]["api-keys.txt"]).decode() == API_KEY_FILE
    assert sorted(secrets["kvserve-transport-keys"]) == sorted(
        Path(f).name for f in key_files("/keys")
    )
    # Kustomize adds the namespace and labels only: the pods are the checked source's.
    for doc in source:
        if doc.get("spec", {}).get("template"):
            out = _find(rendered, doc["kind"], doc["metadata"]["name"])
            assert out is not None and out["spec"]["template"] == doc["spec"]["template"]


def test_manifests_match_the_kubernetes_schemas(rendered):
    validate = pytest.importorskip(
        "kubernetes_validate",
        reason="kubernetes-validate (kvserve's `test` extra) is not installed",
    )
    checked: list[Any] = []
    for doc in rendered:
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # a CRD: no bundled schema; its fields are checked above
        # 1.28: the oldest Kubernetes with the pod-index label the engines read.
        validate.validate(doc, "1.28.0", strict=True)
        checked.append(doc["kind"])
    assert sorted(set(checked)) == [
        "Deployment",
        "Namespace",
        "PersistentVolumeClaim",
        "Secret",
        "Service",
        "StatefulSet",
    ]
    # The schema check can fail: a misspelt field of the engines' StatefulSet is refused.
    engine = _find(rendered, *WORKLOADS["engine"])
    assert engine is not None
    misspelt = {**engine, "spec": {**engine["spec"], "replica": 2}}
    with pytest.raises(validate.ValidationError):
        validate.validate(misspelt, "1.28.0", strict=True)


def _pod_spec(file: str, kind: str) -> dict:
    docs = yaml.safe_load_all((MANIFESTS / file).read_text())
    return next(d for d in docs if d and d["kind"] == kind)["spec"]["template"]["spec"]


def test_the_init_container_makes_a_keys_folder_kvserve_loads(tmp_path):
    """The init container's script, run on a folder laid out as a Secret volume (files as
    links into ..data), leaves owner-only keys that kvserve loads."""
    pod = _pod_spec("engine.yaml", "StatefulSet")
    init = pod["initContainers"][0]
    mounts = {m["name"]: m["mountPath"] for m in init["volumeMounts"]}
    secret_dir, keys_dir = tmp_path / "secret", tmp_path / "keys"
    generate_keys(str(tmp_path / "made"))
    (secret_dir / "..data").mkdir(parents=True)
    for made in (tmp_path / "made").iterdir():
        (secret_dir / "..data" / made.name).write_bytes(made.read_bytes())
        (secret_dir / "..data" / made.name).chmod(0o440)
        (secret_dir / made.name).symlink_to(Path("..data") / made.name)
    keys_dir.mkdir()
    script = init["command"][-1]
    script = script.replace(mounts["transport-keys-secret"], str(secret_dir))
    script = script.replace(mounts["kvserve-keys"], str(keys_dir))
    subprocess.run([*init["command"][:-1], script], check=True, timeout=30)
    for path in key_files(str(keys_dir)):
        assert not Path(path).is_symlink() and Path(path).stat().st_mode & 0o777 == 0o600
    assert load_keys(str(keys_dir)).public_key == load_keys(str(tmp_path / "made")).public_key


class _HealthHandler(http.server.BaseHTTPRequestHandler):
    body = b""

    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args: object) -> None:
        pass


def test_an_engine_is_ready_while_the_api_reports_it_serving():
    """The engines' readiness command against a /health body as the api writes it."""
    probe = _pod_spec("engine.yaml", "StatefulSet")["containers"][0]["readinessProbe"]
    server = http.server.HTTPServer(("127.0.0.1", 0), _HealthHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_port}/health"
        command = [w.replace("http://api:8000/health", url) for w in probe["exec"]["command"]]
        command[0] = sys.executable
        _HealthHandler.body = json.dumps(
            {
                "status": "degraded",
                "engines": [
                    {"engine": 0, "state": "serving"},
                    {"engine": 1, "state": "dead"},
                ],
            }
        ).encode()
        ready = {
            index: subprocess.run(
                command, env={**os.environ, "ENGINE_INDEX": str(index)}, timeout=30
            ).returncode
            == 0
            for index in (0, 1, 2)
        }
        assert ready == {0: True, 1: False, 2: False}
    finally:
        server.shutdown()
