"""What a libp2p handler reads from a peer before it knows whether to: the one rule for every handler.

hivemind's stream framing (``P2P.receive_raw_data``) trusts the 8-byte length in front of each message and
buffers that many bytes before the handler runs, so a stranger that claims 192 MiB makes a peer hold
192 MiB before any admission check. Every servicer of this project derives from ``BoundedServicer``
instead, which registers its stream handlers with a reader of its own (same wire format, so hivemind's
stubs still call them) that, for each stream:

1. asks the servicer's ``admission`` (certificate, ban list) before the stream takes a slot or a byte
   is read, so a stranger holds nothing however many streams it opens;
2. refuses it when the caller already holds ``max_streams_per_peer`` streams of this handler; when the
   handler holds ``max_streams`` in all, closes the oldest stream still waiting for its first request
   (an honest caller sends its request as it opens the stream, so only a staller waits) to make room,
   and refuses the new stream only when every stream is busy with a request;
3. closes a stream whose first request has not arrived whole within ``first_request_timeout_s``;
4. reads each 8-byte length and closes the stream, unread, when it exceeds ``max_message_bytes``.

Unary handlers (request and reply in one message) ride the p2p daemon's persistent connection, which
drops a request over its ``persistent_conn_max_msg_size`` (hivemind's default, ``UNARY_MAX_BYTES``)
before it reaches Python; the same ``HandlerBound`` then refuses a parsed request over its own bound and
counts calls per peer. A servicer names a ``HandlerBound`` for every ``rpc_*`` method, derived from its
run's config; registering one without a bound raises, and ``BoundedServicer.registered`` lists every
servicer class for the test that holds the rule.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import closing, suppress
from dataclasses import dataclass
from typing import Any, ClassVar

from google.protobuf.message import DecodeError, Message
from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase
from hivemind.p2p.p2p_daemon_bindings.control import DEFAULT_MAX_MSG_SIZE, P2PHandlerError
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo
from hivemind.p2p.servicer import RPCHandler, StubBase
from hivemind.proto.p2pd_pb2 import RPCError
from hivemind.utils.asyncio import as_aiter

from protocols.errors import ConfigError, MessageTooLarge, ProtocolError

logger = logging.getLogger(__name__)

UNARY_MAX_BYTES = DEFAULT_MAX_MSG_SIZE  # what the p2p daemon lets through to a unary handler
MAX_STREAMS = 256  # streams of one handler open at once, from all peers
MAX_PREFETCH = 5  # requests of one stream read ahead of the handler (hivemind's default)
# How long a stream may wait for its first request: callers send it as they open the stream, and a part
# stream's first chunk waits at most for its upload throttle.
FIRST_REQUEST_TIMEOUT_S = 30.0
MAX_FIRST_REQUEST_TIMEOUT_S = 600.0
# How long a refused stream is kept open, its bytes discarded as they come, so that the caller's request
# in flight does not reset the stream before the caller has read why it was refused.
REFUSAL_LINGER_S = 1.0
SMALL_REQUEST_BYTES = 4096  # a request of a few scalar fields and short strings


@dataclass(frozen=True)
class HandlerBound:
    """What one handler accepts: ``max_message_bytes`` per request message (the largest one the handler
    can use), ``max_streams_per_peer`` open at once from one caller, ``max_streams`` from all callers, and
    ``first_request_timeout_s`` for a stream's first request to arrive whole."""

    max_message_bytes: int
    max_streams_per_peer: int
    max_streams: int = MAX_STREAMS
    first_request_timeout_s: float = FIRST_REQUEST_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.max_message_bytes <= 0 or self.max_streams_per_peer <= 0 or self.max_streams <= 0:
            raise ConfigError(f"a handler bound must be positive: {self}")
        if not 0 < self.first_request_timeout_s <= MAX_FIRST_REQUEST_TIMEOUT_S:
            raise ConfigError(
                f"first_request_timeout_s must be in (0, {MAX_FIRST_REQUEST_TIMEOUT_S:.0f}]: {self}"
            )


Admission = Callable[[str], Awaitable[str | None]]


async def receive_bounded(
    reader: asyncio.StreamReader, message_type: type[Message], max_bytes: int
) -> tuple[Message | None, RPCError | None]:
    """One framed message (hivemind's wire format: marker, 8-byte big-endian length, body), or
    MessageTooLarge, raised before the body is read, when the length exceeds ``max_bytes``."""
    marker = await reader.readexactly(1)
    if marker not in (P2P.MESSAGE_MARKER, P2P.ERROR_MARKER):
        raise ProtocolError(f"unknown message marker {marker!r}")
    size = int.from_bytes(await reader.readexactly(P2P.HEADER_LEN), P2P.BYTEORDER)
    if size > max_bytes:
        raise MessageTooLarge(f"a message of {size} bytes exceeds this handler's limit of {max_bytes}")
    body = await reader.readexactly(size)
    if marker == P2P.ERROR_MARKER:
        return None, RPCError.FromString(body)
    return message_type.FromString(body), None


class _Slots:
    """Open streams of one handler, per caller and in all; holds only callers with a stream open now.

    A stream is idle until its first request has arrived whole; when the handler is full, a new stream
    takes the place of the oldest idle one, whose ``evict`` callback closes it."""

    def __init__(self, bound: HandlerBound):
        self.bound = bound
        self.open: Counter[str] = Counter()
        self.live: dict[object, str] = {}  # stream token -> caller
        self.idle: dict[object, Callable[[], None]] = {}  # insertion order: the oldest first
        self.evicted = 0
        self.asking: Counter[str] = Counter()  # admission checks in flight, per caller

    async def admit(self, peer: str, admission: Admission) -> str | None:
        """``admission``'s answer for ``peer``, with at most ``max_streams_per_peer`` of its checks in flight:
        a check that reads the DHT takes a while, and a caller must not start thousands at once."""
        if self.asking[peer] >= self.bound.max_streams_per_peer:
            return f"{peer} already has {self.bound.max_streams_per_peer} streams waiting for admission"
        self.asking[peer] += 1
        try:
            return await admission(peer)
        finally:
            self.asking[peer] -= 1
            if self.asking[peer] <= 0:
                del self.asking[peer]

    def enter(self, peer: str, token: object, evict: Callable[[], None]) -> str | None:
        if self.open[peer] >= self.bound.max_streams_per_peer:
            return f"{peer} already has {self.bound.max_streams_per_peer} streams open to this handler"
        if sum(self.open.values()) >= self.bound.max_streams:
            if not self.idle:
                return f"this handler already serves {self.bound.max_streams} streams"
            oldest = next(iter(self.idle))
            close = self.idle[oldest]
            self.leave(oldest)
            self.evicted += 1
            close()
        self.open[peer] += 1
        self.live[token] = peer
        self.idle[token] = evict
        return None

    def busy(self, token: object) -> None:
        """The stream's first request has arrived: it is no longer closed to make room."""
        self.idle.pop(token, None)

    def leave(self, token: object) -> None:
        """The stream ended (or was closed to make room; then this is a no-op the second time)."""
        self.idle.pop(token, None)
        peer = self.live.pop(token, None)
        if peer is None:
            return
        self.open[peer] -= 1
        if self.open[peer] <= 0:
            del self.open[peer]


class BoundedServicer(ServicerBase):
    """A hivemind servicer whose every handler reads at most what it can use, from admitted peers only.

    ``bounds`` maps each ``rpc_*`` method to a function of the servicer giving its ``HandlerBound`` (a
    class attribute, so that a test can check every servicer without building one).

    Example::

        class Echo(BoundedServicer):
            bounds = {"rpc_echo": lambda self: HandlerBound(max_message_bytes=1024, max_streams_per_peer=2)}

            async def rpc_echo(self, request: Msg, context: P2PContext) -> AsyncIterator[Msg]:
                yield request

        await Echo().add_p2p_handlers(p2p, namespace="run_echo")
    """

    registered: ClassVar[list[type[BoundedServicer]]] = []
    bounds: ClassVar[dict[str, Callable[[Any], HandlerBound]]] = {}
    reply_bytes: ClassVar[
        dict[str, int]
    ] = {}  # the largest reply message a caller reads, per streaming handler
    inbound_refused: int = 0

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        BoundedServicer.registered.append(cls)

    @classmethod
    def _collect_rpc_handlers(cls) -> None:
        # hivemind caches the handlers on the first class asked; a subclass must not inherit another's list.
        if "_rpc_handlers" not in cls.__dict__:
            cls._rpc_handlers = None
            super()._collect_rpc_handlers()

    @classmethod
    def unbounded_handlers(cls) -> list[str]:
        """The ``rpc_*`` methods of this class that have no entry in ``bounds`` (registering refuses them)."""
        cls._collect_rpc_handlers()
        return [
            h.method_name
            for h in cls._rpc_handlers
            if h.method_name not in cls.bounds or (h.stream_output and h.method_name not in cls.reply_bytes)
        ]

    @classmethod
    def _make_rpc_caller(cls, handler: RPCHandler) -> Callable:
        if not handler.stream_input and not handler.stream_output:
            return super()._make_rpc_caller(handler)  # the daemon bounds unary replies

        async def caller(self: StubBase, input: Any, timeout: float | None = None) -> Any:
            if handler.stream_output and timeout is not None:
                raise ValueError("timeouts for handlers returning streams are not supported")
            max_bytes = cls.reply_bytes.get(handler.method_name, UNARY_MAX_BYTES)
            name = cls._get_handle_name(self._namespace, handler.method_name)
            requests = input if isinstance(input, AsyncIterator) else as_aiter(input)
            replies = await call_bounded(
                self._p2p, self._peer, name, requests, handler.response_type, max_bytes
            )
            if handler.stream_output:
                return replies
            return await asyncio.wait_for(_first(replies), timeout)

        caller.__name__ = handler.method_name
        return caller

    async def admission(self, peer_id: str) -> str | None:
        """Why ``peer_id`` may not send to this servicer at all (asked before its stream takes a slot or its
        first byte is read); None: it may. It answers from what the servicer holds (a refresh from the DHT
        throttled, as ``PeerPolicy``'s): every stranger's stream asks it. The default admits everyone."""
        return None

    def _checked_bounds(self) -> dict[str, HandlerBound]:
        missing = self.unbounded_handlers()
        if missing:
            raise ConfigError(f"{type(self).__name__} has no inbound bound for {', '.join(missing)}")
        return {name: bound(self) for name, bound in self.bounds.items()}

    async def add_p2p_handlers(
        self, p2p: P2P, wrapper: Any = None, *, namespace: str | None = None, balanced: bool = False
    ) -> None:
        bounds = self._checked_bounds()
        servicer = self if wrapper is None else wrapper
        for handler in self._rpc_handlers:
            name = self._get_handle_name(namespace, handler.method_name)
            bound, method = bounds[handler.method_name], getattr(servicer, handler.method_name)
            if handler.stream_input or handler.stream_output:
                serve = self._stream_handler(
                    p2p, name, method, handler.request_type, handler.stream_input, bound
                )
                await p2p.add_binary_stream_handler(name, serve, balanced=balanced)
            else:
                unary = self._unary_handler(method, bound)
                await p2p.add_protobuf_handler(name, unary, handler.request_type, balanced=balanced)

    def _refuse(self, peer: str, name: str, reason: str) -> None:
        self.inbound_refused += 1
        logger.info(f"refused a stream to {name} from {peer}: {reason}")

    def _unary_handler(self, method: Callable, bound: HandlerBound) -> Callable:
        if bound.max_message_bytes > UNARY_MAX_BYTES:
            raise ConfigError(
                f"a unary handler cannot take {bound.max_message_bytes} bytes (daemon: {UNARY_MAX_BYTES})"
            )
        slots = _Slots(bound)

        async def serve(request: Message, context: P2PContext) -> Message:
            peer, token = context.remote_id.to_base58(), object()
            if request.ByteSize() > bound.max_message_bytes:
                reason = (
                    f"a request of {request.ByteSize()} bytes exceeds the limit of {bound.max_message_bytes}"
                )
            else:  # a unary request has arrived whole: its slot is busy from the start
                reason = await slots.admit(peer, self.admission) or slots.enter(peer, token, lambda: None)
                slots.busy(token)
            if reason is not None:
                self._refuse(peer, context.handle_name, reason)
                raise ProtocolError(reason)
            try:
                return await method(request, context)
            finally:
                slots.leave(token)

        return serve

    def _stream_handler(
        self, p2p: P2P, name: str, method: Callable, request_type: type[Message], stream_input: bool,
        bound: HandlerBound,
    ) -> Callable:  # fmt: skip
        slots = _Slots(bound)

        async def serve(info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            peer, token, evicted = info.peer_id.to_base58(), object(), asyncio.Event()
            with closing(writer):
                reason = await slots.admit(peer, self.admission) or slots.enter(peer, token, evicted.set)
                if reason is not None:
                    self._refuse(peer, name, reason)
                    with suppress(Exception):
                        await P2P.send_protobuf(RPCError(message=reason), writer)
                        await asyncio.wait_for(_discard(reader), REFUSAL_LINGER_S)
                    return
                try:
                    context = P2PContext(handle_name=name, local_id=p2p.peer_id, remote_id=info.peer_id)
                    stream = _Stream(reader, writer, request_type, bound, evicted, lambda: slots.busy(token))
                    await self._pump(stream, method, stream_input, context)
                finally:
                    slots.leave(token)

        return serve

    async def _pump(self, stream: _Stream, method: Callable, stream_input: bool, context: P2PContext) -> None:
        """hivemind's ``_handle_stream`` with a bounded reader: requests are read ahead into a queue of
        ``MAX_PREFETCH`` while the handler answers, and a broken request ends the stream, as does a first
        request that has not arrived whole within the bound's ``first_request_timeout_s`` or a stream
        closed to make room while it still waited for it."""
        requests: asyncio.Queue[Message | None] = asyncio.Queue(MAX_PREFETCH)
        writer, bound = stream.writer, stream.bound

        async def incoming() -> AsyncIterator[Message]:
            while (request := await requests.get()) is not None:
                yield request

        async def answer() -> None:
            try:
                source = incoming()
                output = method(source if stream_input else await _first(source), context)
                if not isinstance(output, AsyncIterator):
                    output = _single(output)
                async for response in output:
                    try:
                        await P2P.send_protobuf(response, writer)
                    except Exception:
                        return  # the caller closed the stream or it broke: the caller sees why
            except Exception as e:
                logger.warning(f"{context.handle_name} failed for {context.remote_id}: {e!r}")
                with suppress(Exception):
                    await P2P.send_protobuf(RPCError(message=str(e)), writer)

        processing = asyncio.create_task(answer())
        evicted = asyncio.create_task(stream.evicted.wait())
        first = True
        try:
            while True:
                receiving = asyncio.create_task(
                    receive_bounded(stream.reader, stream.request_type, bound.max_message_bytes)
                )
                waits = {processing, receiving} | ({evicted} if first else set())
                timeout_s = bound.first_request_timeout_s if first else None
                await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
                if processing.done():
                    receiving.cancel()
                    return
                if not receiving.done():
                    receiving.cancel()
                    why = (
                        "closed to make room for another caller: no request yet"
                        if evicted.done()
                        else f"no request within {bound.first_request_timeout_s:.0f}s"
                    )
                    raise ProtocolError(why)
                try:
                    request, _ = receiving.result()
                except (asyncio.IncompleteReadError, ConnectionError):
                    return  # the caller closed the stream or died
                if first:
                    first = False
                    stream.started()
                await requests.put(request)  # None: the caller's end of stream
        except (ProtocolError, DecodeError) as e:
            self._refuse(context.remote_id.to_base58(), context.handle_name, str(e))
            with suppress(Exception):
                await P2P.send_protobuf(RPCError(message=str(e)), writer)
        finally:
            processing.cancel()
            evicted.cancel()


@dataclass
class _Stream:
    """One inbound stream as ``_pump`` reads it: ``evicted`` is set when it is closed to make room, and
    ``started`` is called once its first request has arrived."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    request_type: type[Message]
    bound: HandlerBound
    evicted: asyncio.Event
    started: Callable[[], None]


async def call_bounded(
    p2p: P2P,
    peer: PeerID,
    name: str,
    requests: AsyncIterator[Message],
    reply_type: type[Message],
    max_bytes: int,
) -> AsyncIterator[Message]:
    """hivemind's ``_iterate_protobuf_stream_handler`` with a bounded reader: a reply whose length exceeds
    ``max_bytes`` ends the call with MessageTooLarge, unread, instead of being buffered."""
    _, reader, writer = await p2p.call_binary_stream_handler(peer, name)

    async def send() -> None:
        async for request in requests:
            await P2P.send_protobuf(request, writer)
        await P2P.send_protobuf(P2P.END_OF_STREAM, writer)

    async def receive() -> AsyncIterator[Message]:
        with closing(writer):
            try:
                while True:
                    try:
                        reply, error = await receive_bounded(reader, reply_type, max_bytes)
                    except asyncio.IncompleteReadError:
                        break
                    except MessageTooLarge as e:
                        raise MessageTooLarge(f"{name} at {peer}: {e}") from None
                    if error is not None:
                        raise P2PHandlerError(f"Failed to call handler `{name}` at {peer}: {error.message}")
                    yield reply
                await sending
            finally:
                sending.cancel()

    sending = asyncio.create_task(send())
    return receive()


async def _discard(reader: asyncio.StreamReader) -> None:
    while await reader.read(1 << 16):
        pass


async def _first(requests: AsyncIterator[Message]) -> Message:
    async for request in requests:
        return request
    raise ProtocolError("the stream ended before its request")


async def _single(reply: Awaitable[Message]) -> AsyncIterator[Message]:
    yield await reply
