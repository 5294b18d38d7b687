"""CURVE on every tcp:// socket between kvserve processes: the deployment's keys, and the
ZAP handler that admits only their holders.

One keypair per deployment, in zmq's certificate format (`kvserve keys generate DIR`), and a
copy of the folder on every node:

    DIR/                   0700
      kvserve.key          0600  the public key: every client's pinned server key, and an
                                 admitted client key
      kvserve.key_secret   0600  the public and the secret key every process of the deployment
                                 proves itself with

A binding tcp:// socket is a CURVE server, and its context runs one ZAP handler thread that
admits a client only if the client's public key is in one of DIR's *.key files (drop another
client's public .key file there to admit it too). A connecting tcp:// socket is a CURVE
client with the deployment keypair. A peer without the secret key cannot finish the
handshake, so libzmq drops its connection and nothing it sends reaches the socket. Servers
set ZAP_ENFORCE_DOMAIN: a server whose handler is missing admits no one, not everyone.

The keys folder comes from $KVSERVE_TRANSPORT_KEYS, which the CLI's --transport-keys sets so
that every process a command spawns inherits it. Without keys a tcp:// socket is refused
(TransportSecurityError) unless $KVSERVE_INSECURE_TRANSPORT (--insecure-transport) allows
plain tcp, with one warning per process. ipc:// and inproc:// sockets stay on one host and
are guarded by file permissions instead (shared/transport.py).
"""

from __future__ import annotations

import functools
import os
import threading
import weakref
from collections.abc import Iterable

import msgspec
import zmq
import zmq.auth
from zmq.utils import z85

from kvserve.shared.env import INSECURE_TRANSPORT, TRANSPORT_KEYS
from kvserve.shared.logging import init_logger

logger = init_logger(__name__)

KEY_NAME = "kvserve"  # DIR/kvserve.key and DIR/kvserve.key_secret
ZAP_DOMAIN = b"kvserve"
_ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # fixed by RFC 27: where libzmq asks
_ZAP_START_TIMEOUT_S = 10.0

_NO_KEYS = (
    "tcp:// sockets between kvserve processes need keys: run `kvserve keys generate DIR`, "
    "copy DIR to every node and pass --transport-keys DIR (or set KVSERVE_TRANSPORT_KEYS); "
    "or pass --insecure-transport (KVSERVE_INSECURE_TRANSPORT=1) to allow plain tcp://, "
    "unencrypted and open to anyone who reaches the ports"
)


class TransportSecurityError(ValueError):
    """A tcp:// socket the transport settings refuse, or an unusable keys folder; the CLI
    shows it as a usage error."""


class TransportKeys(msgspec.Struct, frozen=True):
    """The deployment keypair, as loaded from its folder.

    Args:
        folder: where it was read from (absolute).
        public_key: this process's public key, and the server key clients pin (z85).
        secret_key: this process's secret key (z85).
        client_keys: the public keys servers admit (raw 32 bytes, as ZAP presents them).
    """

    folder: str
    public_key: bytes
    secret_key: bytes
    client_keys: frozenset[bytes]


def key_files(folder: str) -> tuple[str, str]:
    """(public certificate, secret certificate) of the keypair in `folder`."""
    base = os.path.join(folder, KEY_NAME)
    return f"{base}.key", f"{base}.key_secret"


def generate_keys(folder: str, keep_existing: bool = False) -> tuple[str, str]:
    """Write a new deployment keypair into `folder` (made, or made private: 0700; the files
    0600); returns its two files.

    Args:
        keep_existing: a keypair already there is kept (and its files returned) instead of
            refused, so a one-shot compose service can run at every start.

    Raises:
        FileExistsError: `folder` holds a keypair already and keep_existing is False.
    """
    public_file, secret_file = key_files(folder)
    if os.path.exists(secret_file):
        if keep_existing:
            return public_file, secret_file
        raise FileExistsError(
            f"{folder} holds a keypair already ({secret_file}); remove it to make a new one "
            f"(then every node needs a copy of the new folder)"
        )
    os.makedirs(folder, mode=0o700, exist_ok=True)
    os.chmod(folder, 0o700)
    # The files are born owner-only: no moment where another user could read the secret.
    # (umask is process-wide; this runs in the single-threaded `kvserve keys` command.)
    old_umask = os.umask(0o077)
    try:
        zmq.auth.create_certificates(folder, KEY_NAME)
    finally:
        os.umask(old_umask)
    for path in (public_file, secret_file):
        os.chmod(path, 0o600)
    return public_file, secret_file


@functools.cache
def load_keys(folder: str) -> TransportKeys:
    """The keypair in `folder` (an absolute path), read once per process; servers admit its
    public key and those of the folder's other *.key files.

    Raises:
        TransportSecurityError: the folder or its secret certificate is missing or malformed.
    """
    _, secret_file = key_files(folder)
    try:
        public_key, secret_key = zmq.auth.load_certificate(secret_file)
        # Our own key always, and any other client's public .key file in the folder.
        public_keys = {public_key, *zmq.auth.load_certificates(folder)}
    except (OSError, ValueError) as exc:
        raise TransportSecurityError(
            f"transport keys {folder}: {exc} (make the folder with `kvserve keys generate "
            f"{folder}`)"
        ) from None
    if secret_key is None or len(secret_key) != 40 or len(public_key) != 40:
        raise TransportSecurityError(
            f"transport keys {folder}: {secret_file} holds no CURVE keypair (make one with "
            f"`kvserve keys generate DIR`)"
        )
    try:
        client_keys = frozenset(z85.decode(key) for key in public_keys)
    except ValueError as exc:
        raise TransportSecurityError(f"transport keys {folder}: a malformed *.key: {exc}") from None
    if os.stat(secret_file).st_mode & 0o077:
        logger.warning("%s can be read by other users: chmod 600 it", secret_file)
    return TransportKeys(folder, public_key, secret_key, client_keys)


_warned_insecure = False


def tcp_keys() -> TransportKeys | None:
    """The keys of this process's tcp:// sockets; None where plain tcp:// is allowed.

    Raises:
        TransportSecurityError: no keys, and plain tcp:// is not allowed.
    """
    global _warned_insecure
    folder = TRANSPORT_KEYS.get()
    if folder:
        return load_keys(os.path.abspath(folder))
    if not INSECURE_TRANSPORT.get():
        raise TransportSecurityError(_NO_KEYS)
    if not _warned_insecure:
        _warned_insecure = True
        logger.warning(
            "tcp:// sockets without keys (--insecure-transport): traffic between kvserve "
            "processes is plain text, and anyone who reaches a port can send to it"
        )
    return None


def configure_transport(
    transport_keys: str | None, insecure_transport: bool | None, addresses: Iterable[str]
) -> None:
    """A command's flags into the environment (the processes it spawns inherit them), then a
    check of the tcp:// addresses it will use, before anything starts.

    Raises:
        TransportSecurityError: a tcp:// address without keys or --insecure-transport, or an
            unusable keys folder.
    """
    if transport_keys is not None:
        os.environ[TRANSPORT_KEYS.name] = os.path.abspath(transport_keys)
    if insecure_transport is not None:
        os.environ[INSECURE_TRANSPORT.name] = "1" if insecure_transport else "0"
    if transport_keys is not None or any(addr.startswith("tcp://") for addr in addresses):
        tcp_keys()


def secure_tcp_socket(ctx: zmq.Context, sock: zmq.Socket, bind: bool) -> None:
    """Make `sock`, a tcp:// socket not yet bound or connected, a CURVE server (bind) or
    client, as this process's transport settings say.

    Raises:
        TransportSecurityError: no keys, and plain tcp:// is not allowed.
    """
    keys = tcp_keys()
    if keys is None:
        return
    sock.curve_secretkey = keys.secret_key
    sock.curve_publickey = keys.public_key
    if bind:
        _ensure_zap_handler(ctx, keys)
        sock.zap_domain = ZAP_DOMAIN
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)  # no handler: no one gets in
        sock.curve_server = True
    else:
        sock.curve_serverkey = keys.public_key


class _ZapHandler(threading.Thread):
    """Answers the ZAP requests (RFC 27) of one context's CURVE servers: a client gets in
    only if its public key is one of `keys.client_keys`. It ends when the context is
    terminated (ctx.term() or ctx.destroy() wakes it with ETERM, and waits for its socket).

    Args:
        ctx: the context (zmq.Context or zmq.asyncio.Context) whose servers it answers.
        keys: the admitted keys.
    """

    def __init__(self, ctx: zmq.Context, keys: TransportKeys):
        super().__init__(name="kvserve-zap", daemon=True)
        # A plain shadow: the same libzmq context (so the same inproc endpoint), with the
        # blocking sockets this thread needs even when `ctx` is a zmq.asyncio one.
        self._ctx: zmq.Context = zmq.Context.shadow(ctx.underlying)
        self.keys = keys
        self._bound = threading.Event()
        self._bind_error: zmq.ZMQError | None = None

    def start_and_wait(self) -> None:
        self.start()
        if not self._bound.wait(_ZAP_START_TIMEOUT_S):
            raise RuntimeError("the ZAP handler thread did not start")
        error = self._bind_error
        if error is not None and error.errno != zmq.EADDRINUSE:
            raise error  # EADDRINUSE: another handler already answers for this context

    def run(self) -> None:
        sock = self._ctx.socket(zmq.REP)
        sock.linger = 0
        try:
            sock.bind(_ZAP_ENDPOINT)
        except zmq.ZMQError as exc:
            self._bind_error = exc
            sock.close()
            return
        finally:
            self._bound.set()
        try:
            while True:
                sock.send_multipart(self._reply(sock.recv_multipart()))
        except zmq.ContextTerminated:
            pass
        finally:
            sock.close()

    def _reply(self, request: list[bytes]) -> list[bytes]:
        # [version, request id, domain, peer address, routing id, mechanism, credentials...]
        if len(request) < 6:
            request_id = request[1] if len(request) > 1 else b""
            return [b"1.0", request_id, b"400", b"malformed ZAP request", b"", b""]
        version, request_id, _, address, _, mechanism, *credentials = request
        if mechanism == b"CURVE" and credentials and credentials[0] in self.keys.client_keys:
            return [version, request_id, b"200", b"OK", KEY_NAME.encode(), b""]
        logger.warning(
            "refused a %s connection from %s: its key is not one of %s",
            mechanism.decode(errors="replace"),
            address.decode(errors="replace"),
            self.keys.folder,
        )
        return [version, request_id, b"400", b"unknown key", b"", b""]


# One handler per context, for as long as the context lives.
_zap_handlers: weakref.WeakKeyDictionary[zmq.Context, _ZapHandler] = weakref.WeakKeyDictionary()
_zap_handlers_lock = threading.Lock()


def _ensure_zap_handler(ctx: zmq.Context, keys: TransportKeys) -> None:
    with _zap_handlers_lock:
        handler = _zap_handlers.get(ctx)
        if handler is not None and handler.is_alive():
            handler.keys = keys
            return
        handler = _ZapHandler(ctx, keys)
        handler.start_and_wait()
        _zap_handlers[ctx] = handler
