"""A direct TCP path for the bulk data of all-reduce rounds, beside hivemind's libp2p streams.

libp2p carries matchmaking, state downloads and every part stream a peer cannot open directly. For the
part streams themselves (tens of megabytes a round) each hop through the p2p daemons costs more CPU than
the whole reduction, so a peer that can be dialed announces a data address in its matchmaking data and
its groupmates stream parts to it over plain TCP. A peer that cannot be dialed (behind NAT, a firewall,
a wrong announced address) is reached through libp2p as before; the caller falls back on any
``NetworkError`` from ``DataPlane.connect``.

Both ends prove their identity first, with the same Ed25519 key as their libp2p peer ID, by signing the
other side's fresh nonce (so a recorded handshake is worthless). After that the stream is a sequence of
frames, each a 4-byte big-endian length and one ``PartChunk``; the payloads are not encrypted (gradients
of a public run are not secret) and a frame larger than the round could need ends the connection.

Wire order (client dials server)::

    server -> client   MAGIC, server nonce (32)
    client -> server   MAGIC, client public key (32), client nonce (32), signature of the server nonce (64)
    server -> client   server public key (32), signature of the client nonce (64)
    both ways          frames
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import re
import time
from collections.abc import AsyncIterator, Callable

from hivemind.p2p import PeerID

from protocols import averaging_pb2 as apb
from protocols.errors import NetworkError, ProtocolError, SecurityError, SwarmError
from protocols.keys import PUBLIC_KEY_BYTES, SIGNATURE_BYTES, PublicKey, SigningKey
from protocols.version import SIGNATURE_DOMAIN

logger = logging.getLogger(__name__)

MAGIC = b"swarm-ar"
NONCE_BYTES = 32
FRAME_HEADER_BYTES = 4
HANDSHAKE_TIMEOUT_S = 5.0
UNREACHABLE_FOR_S = 60.0
MAX_CONNECTIONS = 256
_ADDRESS = re.compile(r"^(?P<host>[0-9A-Za-z.\-]{1,253}|\[[0-9A-Fa-f:.]{2,45}\]):(?P<port>[0-9]{1,5})$")

PartHandler = Callable[[AsyncIterator[apb.PartChunk], PeerID], AsyncIterator[apb.PartChunk]]


def parse_address(text: object) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` as announced by a groupmate; ProtocolError if it is anything else."""
    match = _ADDRESS.match(text) if isinstance(text, str) else None
    port = int(match["port"]) if match else 0
    if not match or not 0 < port < 65536:
        raise ProtocolError(f"data address {str(text)[:80]!r} is not host:port")
    return match["host"].strip("[]"), port


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class FrameStream(asyncio.BufferedProtocol):
    """One TCP connection read straight into each message's own buffer (no intermediate copies).

    asyncio's StreamReader copies every received byte twice (into its buffer, then out of it), which
    for tens of megabytes a round costs more than the reduction itself. Here a pending ``readexactly``
    hands the socket its target buffer; bytes that arrive with no read pending go to a small backlog
    and the socket is paused until someone reads. Writing is the transport's, with ``drain`` honouring
    its flow control.
    """

    BACKLOG_BYTES = 1 << 16

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._target: bytearray | None = None
        self._filled = 0
        self._done: asyncio.Future | None = None
        self._backlog = bytearray()
        self._scratch = bytearray(self.BACKLOG_BYTES)
        self._eof = False
        self._error: Exception | None = None
        self._writable = asyncio.Event()
        self._writable.set()
        self.connected = asyncio.get_running_loop().create_future()

    # --- protocol callbacks --------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        if not self.connected.done():
            self.connected.set_result(None)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._target is not None:
            return memoryview(self._target)[self._filled :]
        return memoryview(self._scratch)

    def buffer_updated(self, nbytes: int) -> None:
        if self._target is None:
            self._backlog += self._scratch[:nbytes]
            if len(self._backlog) >= self.BACKLOG_BYTES:
                self.transport.pause_reading()
            return
        self._filled += nbytes
        if self._filled == len(self._target):
            self._target = None  # full: later bytes go to the backlog until the next read
            self._finish()

    def eof_received(self) -> bool:
        self._eof = True
        self._finish()
        return True  # half-closed: the other side may still read what we write (we close when done)

    def connection_lost(self, exc: Exception | None) -> None:
        self._eof = True
        self._error = exc
        self._writable.set()
        self._finish()

    def pause_writing(self) -> None:
        self._writable.clear()

    def resume_writing(self) -> None:
        self._writable.set()

    def _finish(self) -> None:
        if self._done is not None and not self._done.done():
            self._done.set_result(None)

    # --- the stream interface ------------------------------------------------------------------------

    async def readexactly(self, size: int) -> bytes:
        """``size`` bytes; ``asyncio.IncompleteReadError`` if the peer closes first."""
        target = bytearray(size)
        taken = min(size, len(self._backlog))
        target[:taken] = self._backlog[:taken]
        del self._backlog[:taken]
        if taken < size:
            if self._eof:
                raise asyncio.IncompleteReadError(bytes(target[:taken]), size)
            self._target, self._filled = target, taken
            self._done = asyncio.get_running_loop().create_future()
            self.transport.resume_reading()
            try:
                await self._done
            finally:
                filled, self._target, self._done = self._filled, None, None
                self._filled = 0
            if filled < size:
                raise asyncio.IncompleteReadError(bytes(target[:filled]), size)
        elif not self._eof:
            self.transport.resume_reading()
        return target  # a bytearray: protobuf and numpy read it without another copy

    def write(self, data: bytes) -> None:
        if self.transport.is_closing():
            raise ConnectionResetError("the averaging data connection is closed")
        self.transport.write(data)

    async def drain(self) -> None:
        if self._error is not None:
            raise ConnectionResetError(f"the averaging data connection broke: {self._error!r}")
        await self._writable.wait()

    def can_write_eof(self) -> bool:
        return self.transport.can_write_eof()

    def write_eof(self) -> None:
        self.transport.write_eof()

    def get_extra_info(self, name: str) -> object:
        return self.transport.get_extra_info(name)

    def close(self) -> None:
        self.transport.close()


def _transcript(role: bytes, prefix: str, nonce: bytes, peer: str) -> bytes:
    """What each side signs: its role, the run's averaging prefix, the other side's nonce and peer ID."""
    return b"|".join([SIGNATURE_DOMAIN, b"data-plane", role, prefix.encode(), nonce, peer.encode()])


async def _read(reader: FrameStream, size: int, what: str) -> bytes:
    try:
        return await reader.readexactly(size)
    except asyncio.IncompleteReadError as e:
        raise NetworkError(f"connection closed during {what} ({len(e.partial)} of {size} bytes)") from None


async def read_frames(reader: FrameStream, max_frame: int) -> AsyncIterator[apb.PartChunk]:
    """The frames of one connection until the peer closes it between frames."""
    while True:
        try:
            header = await reader.readexactly(FRAME_HEADER_BYTES)
        except asyncio.IncompleteReadError as e:
            if not e.partial:
                return
            raise ProtocolError("connection closed inside a frame header") from None
        size = int.from_bytes(header, "big")
        if size > max_frame:
            raise ProtocolError(f"frame of {size} bytes exceeds the round's limit of {max_frame}")
        data = await _read(reader, size, "a frame")
        try:
            message = apb.PartChunk.FromString(data)
        except Exception:
            raise ProtocolError("frame is not a valid PartChunk message") from None
        yield message


def write_frame(writer: FrameStream, message: apb.PartChunk) -> None:
    data = message.SerializeToString()
    writer.write(len(data).to_bytes(FRAME_HEADER_BYTES, "big"))
    writer.write(data)


class DataConnection:
    """An authenticated connection to one groupmate; ``exchange`` streams parts out and results back."""

    def __init__(self, stream: FrameStream, max_frame: int):
        self.reader = self.writer = stream
        self.max_frame = max_frame

    async def exchange(self, outgoing: AsyncIterator[apb.PartChunk]) -> AsyncIterator[apb.PartChunk]:
        async def send() -> None:
            async for message in outgoing:
                write_frame(self.writer, message)
                await self.writer.drain()
            if self.writer.can_write_eof():
                self.writer.write_eof()  # the reducer reads to the end of our stream, then answers the rest

        sender = asyncio.create_task(send())
        try:
            async for message in read_frames(self.reader, self.max_frame):
                if sender.done() and sender.exception() is not None:
                    raise NetworkError(f"sending to the reducer failed: {sender.exception()!r}")
                yield message
        except (ConnectionError, OSError) as e:
            raise NetworkError(f"the averaging data connection broke: {e!r}") from None
        finally:
            sender.cancel()
            with contextlib.suppress(BaseException):
                await sender
            self.close()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()


class DataPlane:
    """This peer's TCP listener for part streams, and its dialer for its groupmates' listeners."""

    def __init__(self, key: SigningKey, prefix: str, handler: PartHandler, *, max_frame: int):
        self.key, self.prefix, self.handler, self.max_frame = key, prefix, handler, max_frame
        self.address: str | None = None
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task] = set()
        self._unreachable: dict[str, float] = {}
        self.accepted = 0  # authenticated connections served so far

    async def start(self, host: str, port: int, announce_host: str) -> str:
        try:
            loop = asyncio.get_running_loop()
            self._server = await loop.create_server(self._protocol, host, port)
        except OSError as e:
            raise NetworkError(
                f"could not listen for averaging data on {format_address(host, port)}: {e}"
            ) from None
        bound_port = self._server.sockets[0].getsockname()[1]
        self.address = format_address(announce_host, bound_port)
        return self.address

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for task in list(self._connections):
                task.cancel()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), timeout=2.0)
            self._server = None

    # --- server side ---------------------------------------------------------------------------------

    def _protocol(self) -> FrameStream:
        stream = FrameStream()
        task = asyncio.get_running_loop().create_task(self._accept_when_connected(stream))
        self._connections.add(task)
        task.add_done_callback(self._connections.discard)
        return stream

    async def _accept_when_connected(self, stream: FrameStream) -> None:
        await stream.connected
        await self._accept(stream, stream)

    async def _accept(self, reader: FrameStream, writer: FrameStream) -> None:
        if len(self._connections) > MAX_CONNECTIONS:
            writer.close()
            return
        remote = writer.get_extra_info("peername")
        try:
            sender = await asyncio.wait_for(self._server_handshake(reader, writer), HANDSHAKE_TIMEOUT_S)
            self.accepted += 1
            responses = self.handler(read_frames(reader, self.max_frame), sender)
            async for message in responses:
                write_frame(writer, message)
                await writer.drain()
        except (SwarmError, asyncio.TimeoutError) as e:
            logger.info(f"refused an averaging data connection from {remote}: {e or 'handshake timed out'}")
        except (ConnectionError, OSError) as e:
            logger.debug(f"averaging data connection from {remote} broke: {e!r}")
        finally:
            with contextlib.suppress(Exception):
                writer.close()

    async def _server_handshake(self, reader: FrameStream, writer: FrameStream) -> PeerID:
        nonce = os.urandom(NONCE_BYTES)
        writer.write(MAGIC + nonce)
        await writer.drain()
        hello = bytes(
            await _read(reader, len(MAGIC) + PUBLIC_KEY_BYTES + NONCE_BYTES + SIGNATURE_BYTES, "the hello")
        )
        if not hello.startswith(MAGIC):
            raise ProtocolError("not a swarm averaging data connection")
        body = hello[len(MAGIC) :]
        client = PublicKey(body[:PUBLIC_KEY_BYTES])
        client_nonce = body[PUBLIC_KEY_BYTES : PUBLIC_KEY_BYTES + NONCE_BYTES]
        signature = body[PUBLIC_KEY_BYTES + NONCE_BYTES :]
        client.verify(signature, _transcript(b"client", self.prefix, nonce, self.key.peer_id))
        answer = self.key.sign(_transcript(b"server", self.prefix, client_nonce, client.peer_id))
        writer.write(self.key.public_key.raw + answer)
        await writer.drain()
        return PeerID.from_base58(client.peer_id)

    # --- client side ---------------------------------------------------------------------------------

    async def connect(self, address: str, peer: PeerID, timeout_s: float) -> DataConnection:
        """An authenticated connection to ``peer`` at ``address``; NetworkError or SecurityError if not."""
        if self._unreachable.get(address, 0.0) > time.monotonic():
            raise NetworkError(f"{address} was unreachable moments ago")
        host, port = parse_address(address)
        stream = None
        try:
            loop = asyncio.get_running_loop()
            _, stream = await asyncio.wait_for(loop.create_connection(FrameStream, host, port), timeout_s)
            await asyncio.wait_for(self._client_handshake(stream, stream, peer), HANDSHAKE_TIMEOUT_S)
        except (OSError, asyncio.TimeoutError, SwarmError) as e:
            if stream is not None:
                stream.close()
            self._unreachable[address] = time.monotonic() + UNREACHABLE_FOR_S
            if isinstance(e, SecurityError):
                raise
            raise NetworkError(f"could not open averaging data connection to {address}: {e!r}") from None
        return DataConnection(stream, self.max_frame)

    async def _client_handshake(self, reader: FrameStream, writer: FrameStream, peer: PeerID) -> None:
        greeting = bytes(await _read(reader, len(MAGIC) + NONCE_BYTES, "the greeting"))
        if not greeting.startswith(MAGIC):
            raise ProtocolError("the data address does not speak the swarm averaging protocol")
        expected = peer.to_base58()
        nonce = os.urandom(NONCE_BYTES)
        signature = self.key.sign(_transcript(b"client", self.prefix, greeting[len(MAGIC) :], expected))
        writer.write(MAGIC + self.key.public_key.raw + nonce + signature)
        await writer.drain()
        answer = bytes(await _read(reader, PUBLIC_KEY_BYTES + SIGNATURE_BYTES, "the server's answer"))
        server = PublicKey(answer[:PUBLIC_KEY_BYTES])
        if server.peer_id != expected:
            raise SecurityError(f"the data address answered as {server.peer_id}, not as {expected}")
        server.verify(answer[PUBLIC_KEY_BYTES:], _transcript(b"server", self.prefix, nonce, self.key.peer_id))


def announce_host(bind_host: str, visible_hosts: list[str]) -> str:
    """The host to announce for a listener bound to ``bind_host``, given the DHT's visible addresses."""
    with contextlib.suppress(ValueError):
        if not ipaddress.ip_address(bind_host).is_unspecified:
            return bind_host
    candidates = []
    for host in visible_hosts:
        with contextlib.suppress(ValueError):
            address = ipaddress.ip_address(host)
            if not address.is_unspecified:
                candidates.append(address)
    # Prefer a global address, then a private one; loopback only when it is all there is.
    candidates.sort(key=lambda a: (a.is_loopback, a.is_private, a.version))
    return str(candidates[0]) if candidates else "127.0.0.1"
