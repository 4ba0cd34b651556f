"""A direct TCP path for the bulk data of all-reduce rounds, beside hivemind's libp2p streams.

libp2p carries matchmaking, state downloads and every part stream a peer cannot open directly. For the
part streams themselves (tens of megabytes a round) each hop through the p2p daemons costs more CPU than
the whole reduction, so a peer that can be dialed announces a data address in its matchmaking data and
its groupmates stream parts to it over plain TCP. A peer that cannot be dialed (behind NAT, a firewall,
a wrong announced address) is reached through libp2p as before; the caller falls back on any
``NetworkError`` from ``DataPlane.connect``.

Both ends prove their identity first, with the same Ed25519 key as their libp2p peer ID, by signing the
other side's fresh nonce (so a recorded handshake is worthless), and the listener asks its ``admission``
(certificate, ban list) about the proven key before it answers or reads a frame. After that the stream is a sequence of
frames, each a 4-byte big-endian length and one ``PartChunk``; the payloads are not encrypted (gradients
of a public run are not secret) and a frame larger than the round could need ends the connection.

Limits, so that one groupmate cannot take the listener from the others: at most
``max_handshakes_per_host`` unauthenticated connections per remote address at once, at most
``max_connections_per_host`` connections of either kind per remote address (an IPv6 /64 counts as one
address: ``host_key``), so that fresh keys from one host cannot fill the listener, at most
``max_connections_per_peer`` authenticated ones per peer ID, ``max_connections`` in all; and every
write waits at most ``write_timeout_s`` for the other side to read (a groupmate that never reads would
otherwise hold the sending task forever).

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
from collections.abc import AsyncIterator, Awaitable, Callable

from hivemind.p2p import PeerID

from protocols import averaging_pb2 as apb
from protocols.errors import AdmissionDenied, NetworkError, ProtocolError, SecurityError, SwarmError
from protocols.keys import PUBLIC_KEY_BYTES, SIGNATURE_BYTES, PublicKey, SigningKey
from protocols.version import SIGNATURE_DOMAIN

logger = logging.getLogger(__name__)

MAGIC = b"swarm-ar"
NONCE_BYTES = 32
FRAME_HEADER_BYTES = 4
HANDSHAKE_TIMEOUT_S = 5.0
UNREACHABLE_FOR_S = 60.0
MAX_CONNECTIONS = 256
MAX_CONNECTIONS_PER_PEER = 8
MAX_HANDSHAKES_PER_HOST = 32
# A quarter of MAX_CONNECTIONS: one host (or one IPv6 /64) never holds more, whatever keys it signs with.
# Peers sharing an address (behind one NAT, or a rehearsal on loopback) beyond it fall back to libp2p.
MAX_CONNECTIONS_PER_HOST = 64
WRITE_TIMEOUT_S = 30.0
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

    def abort(self) -> None:
        """Close now, dropping unsent bytes (``close`` would wait for a peer that never reads)."""
        self.transport.abort()


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


async def drain_within(writer: FrameStream, timeout_s: float, whom: object) -> None:
    """Wait for the other side to take what was written; NetworkError if it reads nothing for ``timeout_s``."""
    try:
        await asyncio.wait_for(writer.drain(), timeout_s)
    except asyncio.TimeoutError:
        raise NetworkError(f"{whom} read nothing for {timeout_s:.0f}s; closing the data connection") from None


class DataConnection:
    """An authenticated connection to one groupmate; ``exchange`` streams parts out and results back."""

    def __init__(self, stream: FrameStream, max_frame: int, *, write_timeout_s: float = WRITE_TIMEOUT_S):
        self.reader = self.writer = stream
        self.max_frame = max_frame
        self.write_timeout_s = write_timeout_s

    async def exchange(self, outgoing: AsyncIterator[apb.PartChunk]) -> AsyncIterator[apb.PartChunk]:
        async def send() -> None:
            try:
                async for message in outgoing:
                    write_frame(self.writer, message)
                    await drain_within(self.writer, self.write_timeout_s, "the reducer")
                if self.writer.can_write_eof():
                    self.writer.write_eof()  # the reducer reads to the end of our stream, then answers
            except BaseException:
                self.writer.abort()  # so the read below ends too, instead of waiting on a stalled reducer
                raise

        sender = asyncio.create_task(send())
        try:
            async for message in read_frames(self.reader, self.max_frame):
                if sender.done() and sender.exception() is not None:
                    raise NetworkError(f"sending to the reducer failed: {sender.exception()!r}")
                yield message
            if sender.done() and not sender.cancelled() and sender.exception() is not None:
                raise NetworkError(f"sending to the reducer failed: {sender.exception()}")
        except (ConnectionError, OSError) as e:
            if sender.done() and not sender.cancelled() and sender.exception() is not None:
                raise NetworkError(f"sending to the reducer failed: {sender.exception()}") from None
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

    def __init__(
        self,
        key: SigningKey,
        prefix: str,
        handler: PartHandler,
        *,
        max_frame: int,
        max_connections: int = MAX_CONNECTIONS,
        max_connections_per_peer: int = MAX_CONNECTIONS_PER_PEER,
        max_handshakes_per_host: int = MAX_HANDSHAKES_PER_HOST,
        max_connections_per_host: int = MAX_CONNECTIONS_PER_HOST,
        write_timeout_s: float = WRITE_TIMEOUT_S,
        admission: Callable[[str], Awaitable[str | None]] | None = None,
    ):
        self.key, self.prefix, self.handler, self.max_frame = key, prefix, handler, max_frame
        self.admission = admission
        self.max_connections = max_connections
        self.max_connections_per_peer = max_connections_per_peer
        self.max_handshakes_per_host = max_handshakes_per_host
        self.max_connections_per_host = max_connections_per_host
        self.write_timeout_s = write_timeout_s
        self.address: str | None = None
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task] = set()
        # These maps hold only keys with connections open now, so they never outgrow max_connections.
        self._handshaking: dict[str, int] = {}
        self._by_host: dict[str, int] = {}
        self._serving: dict[str, int] = {}
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
        remote = writer.get_extra_info("peername")
        host = host_key(str(remote[0])) if isinstance(remote, tuple) and remote else "unknown"
        if len(self._connections) > self.max_connections or not _enter(
            self._by_host, host, self.max_connections_per_host
        ):
            logger.debug(f"refused an averaging data connection from {host}: too many connections")
            writer.close()
            return
        if not _enter(self._handshaking, host, self.max_handshakes_per_host):
            _leave(self._by_host, host)
            logger.debug(f"refused an averaging data connection from {host}: too many unfinished handshakes")
            writer.close()
            return
        sender: PeerID | None = None
        finished = False
        try:
            try:
                sender = await asyncio.wait_for(self._server_handshake(reader, writer), HANDSHAKE_TIMEOUT_S)
            finally:
                _leave(self._handshaking, host)
            self.accepted += 1
            responses = self.handler(read_frames(reader, self.max_frame), sender)
            async for message in responses:
                write_frame(writer, message)
                await drain_within(writer, self.write_timeout_s, sender)
            finished = True
        except (SwarmError, asyncio.TimeoutError) as e:
            logger.info(f"refused an averaging data connection from {remote}: {e or 'handshake timed out'}")
        except (ConnectionError, OSError) as e:
            logger.debug(f"averaging data connection from {remote} broke: {e!r}")
        finally:
            _leave(self._by_host, host)
            if sender is not None:
                _leave(self._serving, sender.to_base58())
            with contextlib.suppress(Exception):
                writer.close() if finished else writer.abort()

    def _admit_peer(self, peer_id: str) -> None:
        """Count one more connection of an authenticated peer, or refuse it."""
        if not _enter(self._serving, peer_id, self.max_connections_per_peer):
            raise NetworkError(f"{peer_id} already has {self.max_connections_per_peer} data connections open")

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
        refusal = None if self.admission is None else await self.admission(client.peer_id)
        if refusal is not None:
            raise AdmissionDenied(f"{client.peer_id}: {refusal}")
        self._admit_peer(client.peer_id)  # before answering: a refused client's connect() fails
        try:
            answer = self.key.sign(_transcript(b"server", self.prefix, client_nonce, client.peer_id))
            writer.write(self.key.public_key.raw + answer)
            await drain_within(writer, HANDSHAKE_TIMEOUT_S, client.peer_id)
            return PeerID.from_base58(client.peer_id)
        except BaseException:
            _leave(self._serving, client.peer_id)
            raise

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
        return DataConnection(stream, self.max_frame, write_timeout_s=self.write_timeout_s)

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


def host_key(host: str) -> str:
    """What a remote address is limited by: an IPv4 address (also when mapped into IPv6) or an IPv6 /64,
    which one host gets as cheaply as one address; anything unparsable is limited as itself."""
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return host[:128]
    if address.version == 6:
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.ip_network(f"{address}/64", strict=False))
    return str(address)


def _enter(counts: dict[str, int], key: str, limit: int) -> bool:
    if counts.get(key, 0) >= limit:
        return False
    counts[key] = counts.get(key, 0) + 1
    return True


def _leave(counts: dict[str, int], key: str) -> None:
    left = counts.pop(key, 1) - 1
    if left > 0:
        counts[key] = left


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
