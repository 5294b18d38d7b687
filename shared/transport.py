"""ZeroMQ sockets and the frame codec between the api and its engine cores.

Topology (fixed; DESIGN §2, STYLE lesson 4):

    api                                   engine core
    ROUTER (bind) input_addr   <------->  DEALER (connect, identity = engine index)
    PULL   (bind) output_addr  <--------  PUSH   (connect)

With data parallelism every engine core connects to the same two api sockets, and to the
coordinator (stats_addr: its PULL <- engine PUSH); the api subscribes to the coordinator's load
table (publish_addr: its PUB -> api SUB).

Same host: ipc:// in a private (0700) folder of the temp folder, each socket file 0600;
across hosts: tcp://, CURVE-encrypted and authenticated with the deployment's keys
(shared/transport_security.py). A message is a list of frames: the 1-byte `MsgType`, the
msgpack payload, then one frame per numpy array too big to inline.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import typing
from collections.abc import Iterable, Sequence
from typing import Any, TypeVar

import msgspec
import numpy as np
import zmq

from kvserve.shared.transport_security import secure_tcp_socket
from kvserve.shared.wire import PAYLOAD_TYPES, MsgType

# Arrays smaller than this travel inside the msgpack payload: a frame costs more than a copy.
INLINE_ARRAY_MAX_BYTES = 256
_SCHEMES = ("ipc://", "tcp://", "inproc://")
IPC_FOLDER_PREFIX = "kvserve-ipc-"


def private_ipc_folder() -> str:
    """A fresh folder of the temp folder that only this user may enter (0700), for ipc://
    socket files: no other user can connect to what is bound in it."""
    return tempfile.mkdtemp(prefix=IPC_FOLDER_PREFIX)


def remove_ipc_file(addr: str) -> None:
    """Unlink an ipc:// socket file, which libzmq leaves behind, and its private folder
    (`private_ipc_folder`) once that is empty; for the side that bound it, once closed."""
    if not addr.startswith("ipc://"):
        return
    path = addr.removeprefix("ipc://")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    folder = os.path.dirname(path)
    if os.path.basename(folder).startswith(IPC_FOLDER_PREFIX):
        with contextlib.suppress(OSError):  # not empty: another socket of it is still bound
            os.rmdir(folder)


class EngineAddresses(msgspec.Struct, frozen=True):
    """Where the api binds and the engine cores connect.

    Args:
        input_addr: api ROUTER <- engine DEALER (requests, aborts, utilities; READY back).
        output_addr: api PULL <- engine PUSH (outputs, utility results, heartbeats).
    """

    input_addr: str
    output_addr: str

    @classmethod
    def local(cls) -> EngineAddresses:
        """Fresh ipc:// addresses, unique to this launch, for engines on this host (in a
        private folder: see `private_ipc_folder`)."""
        folder = private_ipc_folder()
        return cls(f"ipc://{folder}/input", f"ipc://{folder}/output")

    def remove_ipc_files(self) -> None:
        """Unlink the ipc:// socket files and their private folder; for the side that bound
        them, once its sockets are closed."""
        for addr in (self.input_addr, self.output_addr):
            remove_ipc_file(addr)

    @classmethod
    def tcp(cls, host: str) -> EngineAddresses:
        """Addresses on `host` with ports the OS picks at bind time (see `bound_address`),
        for engines on other hosts."""
        return cls(f"tcp://{host}:*", f"tcp://{host}:*")


class CoordinatorAddresses(msgspec.Struct, frozen=True):
    """Where the DP coordinator binds; engines and api servers connect.

    Args:
        stats_addr: coordinator PULL <- engine PUSH (EngineLoad, on change and periodically).
        publish_addr: coordinator PUB -> api SUB (LoadTable, ~every 100 ms while it changes).
    """

    stats_addr: str
    publish_addr: str

    @classmethod
    def local(cls) -> CoordinatorAddresses:
        folder = private_ipc_folder()
        return cls(f"ipc://{folder}/stats", f"ipc://{folder}/load")

    @classmethod
    def tcp(cls, host: str) -> CoordinatorAddresses:
        return cls(f"tcp://{host}:*", f"tcp://{host}:*")

    def remove_ipc_files(self) -> None:
        for addr in (self.stats_addr, self.publish_addr):
            remove_ipc_file(addr)


def bound_address(sock: zmq.Socket) -> str:
    """The address a bound socket really listens on: `tcp://host:*` becomes the port the OS
    picked, which is what peers must connect to."""
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


def engine_identity(engine_index: int) -> bytes:
    """The DEALER identity of engine `engine_index`: what the api's ROUTER addresses."""
    return engine_index.to_bytes(2, "little")


# A zmq.Socket, or a zmq.asyncio.Socket (whose calls are awaited) from a zmq.asyncio.Context.
_SocketT = TypeVar("_SocketT", bound=zmq.Socket)


def make_socket(
    ctx: zmq.Context[_SocketT],
    addr: str,
    kind: int,
    bind: bool,
    *,
    identity: bytes | None = None,
    linger_ms: int = 0,
) -> _SocketT:
    """One socket of the engine channel, configured the same way on both ends. Every socket
    of kvserve is made here, so one place applies the transport's security: a tcp:// socket
    is a CURVE server (bind) or client with the deployment's keys (TransportSecurityError
    without keys, unless --insecure-transport), and a bound ipc:// socket file is made 0600.

    Args:
        ctx: a zmq.Context or zmq.asyncio.Context (the socket is of the context's kind).
        addr: ipc://path, tcp://host:port (tcp://*:port to bind every interface) or inproc://.
        kind: zmq.ROUTER, DEALER, PUSH, PULL, PUB or SUB (subscribed to everything).
        bind: bind (the api's side) or connect (the engine's side).
        identity: routing id of a DEALER, so the ROUTER can address it.
        linger_ms: how long close() waits to deliver queued messages (a dying engine
            lingers so its DEAD sentinel gets out).
    """
    if not addr.startswith(_SCHEMES):
        raise ValueError(
            f"socket address {addr!r} must start with one of {_SCHEMES} "
            f"(ipc:// on one host, tcp://host:port across hosts)"
        )
    sock = ctx.socket(kind)
    try:
        # No high-water mark: a full queue would drop (PUSH blocks, ROUTER drops) messages we
        # cannot lose; the scheduler's max_num_seqs already bounds what is in flight.
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.LINGER, linger_ms)
        if identity is not None:
            sock.setsockopt(zmq.IDENTITY, identity)
        if kind == zmq.SUB:
            sock.setsockopt(zmq.SUBSCRIBE, b"")
        if kind == zmq.ROUTER:
            # Sending to an engine that is not connected raises instead of dropping silently.
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if addr.startswith("tcp://"):
            secure_tcp_socket(ctx, sock, bind)  # before bind/connect: the handshake needs it
        if bind:
            sock.bind(addr)
            if addr.startswith("ipc://"):
                _restrict_ipc_file(sock)
        else:
            sock.connect(addr)
    except BaseException:
        sock.close(linger=0)  # an open socket would block the context's term()
        raise
    return sock


def _restrict_ipc_file(sock: zmq.Socket) -> None:
    """Owner-only (0600) permissions on a bound ipc:// socket file: connecting needs write
    permission on it. Folders from `private_ipc_folder` are private already; this covers
    paths given on the command line (`kvserve kv-store --address ipc://...`)."""
    path = bound_address(sock).removeprefix("ipc://")
    if not path.startswith("@"):  # @name: Linux's abstract namespace, no file
        os.chmod(path, 0o600)


class MsgpackEncoder:
    """obj -> [payload, *array frames]; numpy arrays over INLINE_ARRAY_MAX_BYTES become extra
    zero-copy frames, referenced in the payload as (dtype, shape, frame index).

    Not thread-safe: one per sending thread.
    """

    def __init__(self):
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self._frames: list[bytes | memoryview] | None = None  # frames of the object being encoded

    def encode(self, obj: Any, first_frames: Sequence[bytes] = ()) -> list[bytes | memoryview]:
        """Frames of `obj`, after `first_frames` (which array frame indices count in)."""
        self._frames = [*first_frames, b""]
        payload_index = len(self._frames) - 1
        try:
            self._frames[payload_index] = self._encoder.encode(obj)
            return self._frames
        finally:
            self._frames = None

    def _enc_hook(self, obj: Any) -> Any:
        if isinstance(obj, np.ndarray) and not obj.dtype.hasobject:
            arr = np.ascontiguousarray(obj)
            if arr.nbytes < INLINE_ARRAY_MAX_BYTES:
                return arr.dtype.str, arr.shape, arr.tobytes()
            frames = self._frames
            assert frames is not None, "the hook runs only inside encode()"
            # Zero-copy: zmq keeps a reference to the buffer until the frame is sent.
            frames.append(arr.data)
            return arr.dtype.str, arr.shape, len(frames) - 1
        raise TypeError(
            f"{type(obj).__name__} cannot cross the engine socket: send msgspec "
            f"Structs, builtins or numpy arrays (never pickle)"
        )


class MsgpackDecoder:
    """frames -> obj of type `type_`, built once per type; the inverse of MsgpackEncoder.

    Args:
        type_: what the payload decodes to (validated by msgspec).
    """

    def __init__(self, type_: Any):
        self._decoder = msgspec.msgpack.Decoder(type_, dec_hook=self._dec_hook)
        self._frames: Sequence[memoryview] = ()  # frames of the message being decoded

    def decode(self, frames: Sequence[memoryview], payload_index: int = 0) -> Any:
        self._frames = frames
        try:
            return self._decoder.decode(frames[payload_index])
        finally:
            self._frames = ()

    def _dec_hook(self, type_: type, obj: Any) -> Any:
        if type_ is np.ndarray:
            dtype, shape, data = obj
            buffer = self._frames[data] if isinstance(data, int) else data
            # A read-only view on the received frame: no copy.
            return np.frombuffer(buffer, dtype=np.dtype(dtype)).reshape(shape)
        raise TypeError(f"no decoder for {type_!r}")


class MessageEncoder:
    """(MsgType, payload) -> [type byte, payload, *array frames]. One per sending thread."""

    def __init__(self):
        self._encoder = MsgpackEncoder()

    def encode(self, msg_type: MsgType, payload: Any) -> list[bytes | memoryview]:
        expected = typing.get_origin(PAYLOAD_TYPES[msg_type]) or PAYLOAD_TYPES[msg_type]
        assert isinstance(payload, expected), (
            f"{msg_type.name} carries {expected.__name__}, got {type(payload).__name__}"
        )
        return self._encoder.encode(payload, first_frames=(msg_type.frame,))


class MessageDecoder:
    """[type byte, payload, *array frames] -> (MsgType, payload), typed per MsgType.

    Args:
        msg_types: the types this receiver accepts; anything else is a ValueError.
    """

    def __init__(self, msg_types: Iterable[MsgType]):
        self._decoders = {t: MsgpackDecoder(PAYLOAD_TYPES[t]) for t in msg_types}

    def decode(self, frames: Sequence[bytes | memoryview | zmq.Frame]) -> tuple[MsgType, Any]:
        buffers = [f.buffer if isinstance(f, zmq.Frame) else memoryview(f) for f in frames]
        if len(buffers) < 2 or len(buffers[0]) != 1:
            raise ValueError(
                f"malformed message of {len(buffers)} frames: expected a 1-byte "
                f"type frame and a payload frame"
            )
        type_byte = buffers[0][0]
        try:
            msg_type = MsgType(type_byte)
            decoder = self._decoders[msg_type]
        except (ValueError, KeyError):
            raise ValueError(
                f"unexpected message type {type_byte} here (expected one of "
                f"{sorted(t.name for t in self._decoders)}): is the peer a "
                f"kvserve of the same version?"
            ) from None
        return msg_type, decoder.decode(buffers, payload_index=1)
