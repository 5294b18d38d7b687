"""The transport's rules: keys files, tcp:// refused without keys, --insecure-transport,
the CLI's usage error, and owner-only ipc:// files and shared memory.

Messages from peers without the key are dropped: tests/faults/test_transport_security.py.
"""

from __future__ import annotations

import logging
import os
import re
import stat
import threading

import pytest
import zmq
import zmq.auth
from zmq.utils import z85

from kvserve.cli import configure_command_transport, main, parse_options
from kvserve.services.kv_store.arena import HostArena
from kvserve.shared import transport_security
from kvserve.shared.env import INSECURE_TRANSPORT, TRANSPORT_KEYS
from kvserve.shared.shm_ring import ShmRingBuffer
from kvserve.shared.transport import (
    CoordinatorAddresses,
    EngineAddresses,
    bound_address,
    make_socket,
    remove_ipc_file,
)
from kvserve.shared.transport_security import (
    TransportSecurityError,
    generate_keys,
    key_files,
    load_keys,
)
from tests.support import REPO_ROOT
from tests.support.ports import free_port


def _mode(path: str) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def no_transport_env(monkeypatch):
    """Neither keys nor --insecure-transport (the conftest's session keys removed); what the
    CLI exports is undone after the test."""
    monkeypatch.delenv(TRANSPORT_KEYS.name, raising=False)
    monkeypatch.delenv(INSECURE_TRANSPORT.name, raising=False)
    monkeypatch.setattr(transport_security, "_warned_insecure", False)


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    _terminate_within(context, timeout_s=5)


def _terminate_within(context: zmq.Context, timeout_s: float) -> None:
    """term() in a thread: it hangs while any socket of the context is open (a leak)."""
    thread = threading.Thread(target=context.term, daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert not thread.is_alive(), "context.term() hung: a socket was left open"


def test_every_zmq_socket_is_made_by_make_socket():
    """One place applies the transport's security: a socket made elsewhere would skip it."""
    made_here = {("shared", "transport.py"), ("shared", "transport_security.py")}  # the ZAP REP
    direct = []
    for package in ("kvserve", "shared", "services"):
        for path in sorted((REPO_ROOT / package).rglob("*.py")):
            if path.relative_to(REPO_ROOT).parts[-2:] in made_here:
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if re.search(r"(?<!\bsocket)\.socket\(", line.split("#")[0]):
                    direct.append(f"{path.relative_to(REPO_ROOT)}:{number}: {line.strip()}")
    assert not direct, "zmq sockets not made by make_socket:\n" + "\n".join(direct)


def test_generate_writes_owner_only_files_and_never_overwrites(tmp_path):
    folder = str(tmp_path / "keys")
    public_file, secret_file = generate_keys(folder)
    assert (public_file, secret_file) == key_files(folder)
    assert _mode(folder) == 0o700
    assert _mode(public_file) == _mode(secret_file) == 0o600
    keys = load_keys(folder)
    assert len(keys.public_key) == len(keys.secret_key) == 40  # z85
    assert keys.client_keys == {z85.decode(keys.public_key)}
    with pytest.raises(FileExistsError, match="holds a keypair already"):
        generate_keys(folder)
    before = open(secret_file).read()
    assert generate_keys(folder, keep_existing=True) == (public_file, secret_file)
    assert open(secret_file).read() == before


def test_servers_admit_the_public_keys_of_every_key_file_in_the_folder(tmp_path):
    folder = str(tmp_path / "keys")
    generate_keys(folder)
    os.remove(key_files(folder)[0])  # our own key is admitted even without its .key file
    guest_file, _ = zmq.auth.create_certificates(folder, "guest")
    guest_public, _ = zmq.auth.load_certificate(guest_file)
    keys = load_keys(folder)
    assert keys.client_keys == {z85.decode(keys.public_key), z85.decode(guest_public)}


def test_keys_generate_command(tmp_path, capsys):
    folder = str(tmp_path / "deployment")
    assert main(["keys", "generate", folder]) == 0
    out = capsys.readouterr().out
    assert key_files(folder)[1] in out and "--transport-keys" in out
    assert main(["keys", "generate", folder]) == 1
    assert "holds a keypair already" in capsys.readouterr().err
    assert main(["keys", "generate", folder, "--keep-existing"]) == 0


def test_tcp_without_keys_is_refused_naming_both_flags(no_transport_env, ctx):
    address = f"tcp://127.0.0.1:{free_port()}"
    for bind in (True, False):
        with pytest.raises(TransportSecurityError) as refused:
            make_socket(ctx, address, zmq.PULL if bind else zmq.PUSH, bind=bind)
        assert "--transport-keys" in str(refused.value)
        assert "--insecure-transport" in str(refused.value)
    # ipc:// and inproc:// need no keys.
    make_socket(ctx, "inproc://no-keys", zmq.PULL, bind=True).close()
    # The ctx fixture's term() proves the refused sockets were closed.


def test_insecure_transport_allows_plain_tcp_with_one_warning(no_transport_env, ctx, monkeypatch):
    monkeypatch.setenv(INSECURE_TRANSPORT.name, "1")
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger(transport_security.__name__)
    logger.addHandler(handler)
    try:
        pull = make_socket(ctx, "tcp://127.0.0.1:*", zmq.PULL, bind=True)
        push = make_socket(ctx, bound_address(pull), zmq.PUSH, bind=False)
    finally:
        logger.removeHandler(handler)
    push.send(b"plain")
    assert pull.poll(5000) and pull.recv() == b"plain"
    push.close()
    pull.close()
    warnings = [r for r in records if "--insecure-transport" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING


def test_a_missing_or_broken_keys_folder_is_refused(tmp_path, monkeypatch, ctx):
    monkeypatch.setenv(TRANSPORT_KEYS.name, str(tmp_path / "missing"))
    with pytest.raises(TransportSecurityError, match="kvserve keys generate"):
        make_socket(ctx, "tcp://127.0.0.1:*", zmq.PULL, bind=True)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "kvserve.key_secret").write_text('curve\n    public-key = "short"\n')
    monkeypatch.setenv(TRANSPORT_KEYS.name, str(broken))
    with pytest.raises(TransportSecurityError, match="no CURVE keypair"):
        make_socket(ctx, "tcp://127.0.0.1:*", zmq.PULL, bind=True)


def test_the_cli_refuses_tcp_without_keys_before_starting(no_transport_env, capsys):
    argv = ["coordinator", "--stats-addr", "tcp://127.0.0.1:1", "--publish-addr", "ipc:///x"]
    with pytest.raises(SystemExit) as exited:
        main(argv)  # the check comes before the coordinator would bind
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "coordinator:" in err and "--transport-keys" in err and "--insecure-transport" in err
    assert "Traceback" not in err


def test_the_cli_exports_its_flags_to_the_processes_it_starts(no_transport_env, tmp_path):
    folder = str(tmp_path / "keys")
    generate_keys(folder)
    command, options = parse_options(
        ["api", "--input-addr", "tcp://*:1", "--output-addr", "tcp://*:2"]
        + ["--transport-keys", folder]
    )
    configure_command_transport(command, options)
    assert os.environ[TRANSPORT_KEYS.name] == folder
    command, options = parse_options(
        ["engine", "--input-addr", "tcp://a:1", "--output-addr", "tcp://a:2"]
        + ["--insecure-transport"]
    )
    configure_command_transport(command, options)
    assert os.environ[INSECURE_TRANSPORT.name] == "1"
    # Which addresses each command checks: multi-node serve (its rpc port) and the KV store.
    _, serve = parse_options(
        ["serve", "--data-parallel-size", "2", "--data-parallel-size-local", "1"]
        + ["--data-parallel-address", "10.0.0.1", "--data-parallel-rpc-port", "29550"]
    )
    assert serve.socket_addresses == ["tcp://10.0.0.1:29550"]
    _, single = parse_options(["serve"])
    assert single.socket_addresses == []
    _, store = parse_options(["kv-store", "--address", "ipc:///tmp/s,tcp://*:5570"])
    assert store.socket_addresses == ["ipc:///tmp/s", "tcp://*:5570"]


def test_ipc_socket_files_and_their_folder_are_owner_only(ctx):
    engine, coordinator = EngineAddresses.local(), CoordinatorAddresses.local()
    addresses = [engine.input_addr, engine.output_addr]
    addresses += [coordinator.stats_addr, coordinator.publish_addr]
    sockets = [make_socket(ctx, addr, zmq.PULL, bind=True) for addr in addresses]
    paths = [addr.removeprefix("ipc://") for addr in addresses]
    folders = {os.path.dirname(path) for path in paths}
    assert len(folders) == 2  # one private folder per launch's channel
    assert all(_mode(folder) == 0o700 for folder in folders)
    assert all(_mode(path) == 0o600 and stat.S_ISSOCK(os.stat(path).st_mode) for path in paths)
    for sock in sockets:
        sock.close()
    engine.remove_ipc_files()
    coordinator.remove_ipc_files()
    assert not any(os.path.exists(folder) for folder in folders)


def test_an_ipc_path_given_by_the_user_is_made_owner_only(ctx, tmp_path):
    path = str(tmp_path / "store")
    sock = make_socket(ctx, f"ipc://{path}", zmq.ROUTER, bind=True)
    assert _mode(path) == 0o600
    sock.close()
    remove_ipc_file(f"ipc://{path}")
    assert not os.path.exists(path) and tmp_path.exists()  # not a private folder: kept


def test_shared_memory_segments_are_owner_only():
    ring = ShmRingBuffer.create(num_readers=1, num_chunks=2, chunk_bytes=64)
    arena = HostArena.create(f"kvserve-test-arena-{os.getpid()}", num_slots=2, slot_bytes=4096)
    try:
        assert _mode(f"/dev/shm/{ring.handle.name}") == 0o600
        assert _mode(f"/dev/shm/{arena.handle.shm_name}") == 0o600
    finally:
        ring.close()
        arena.close()
