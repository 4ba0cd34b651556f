"""What a libp2p handler reads from a peer before it knows whether to: the one rule for every handler.

hivemind's stream framing (``P2P.receive_raw_data``) trusts the 8-byte length in front of each message and
buffers that many bytes before the handler runs, so a stranger that claims 192 MiB makes a peer hold
192 MiB before any admission check. Every servicer of this project derives from ``BoundedServicer``
instead, which registers its stream handlers with a reader of its own (same wire format, so hivemind's
stubs still call them) that, for each stream:

1. refuses it when the caller already holds ``max_streams_per_peer`` streams of this handler, or the
   handler ``max_streams`` in all, before reading a byte;
2. asks the servicer's ``admission`` (certificate, ban list) before reading a byte;
3. reads each 8-byte length and closes the stream, unread, when it exceeds ``max_message_bytes``;
4. closes it when its first request has not arrived whole within ``FIRST_REQUEST_TIMEOUT_S`` (plus the
   time its largest request takes at 1 Mbit/s), so that a stream that sends nothing, or trickles its
   first message, frees its slot.

A socket closed with unread bytes in it is reset, and the reset can overtake what was sent before it. So a
refused stream gets the reason, then stays open up to ``CLOSE_LINGER_S`` (dropping what still comes,
``MAX_LINGERING_REFUSALS`` of them at once), and a handler that answered before the caller's end of
stream arrived waits for it as long before closing.

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
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
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
SMALL_REQUEST_BYTES = 4096  # a request of a few scalar fields and short strings
# How long a stream stays open after its last reply or refusal, for the caller's last bytes: a socket
# closed with unread bytes in it is reset, and the reset can overtake what was sent before it.
CLOSE_LINGER_S = 1.0
# From a stream's admission until its first request has arrived whole: this, plus the time its largest
# request takes at 1 Mbit/s (the slowest uplink the averaging deadlines count on). Each reply must be
# taken by the caller within the same allowance for the reply's largest message: a caller that stops
# reading ends its stream, and frees the handler's slot, instead of holding it for as long as it likes.
FIRST_REQUEST_TIMEOUT_S = 10.0
FIRST_REQUEST_MIN_BYTES_PER_S = 125_000


def transfer_within_s(nbytes: int) -> float:
    """How long one message of ``nbytes`` may take to cross a stream (see FIRST_REQUEST_TIMEOUT_S)."""
    return FIRST_REQUEST_TIMEOUT_S + nbytes / FIRST_REQUEST_MIN_BYTES_PER_S


REFUSAL_DISCARD_BYTES = 64 << 10  # what a refused stream may still read (and drop) while it lingers
MAX_LINGERING_REFUSALS = 32  # refused streams kept open at once in this process; others close at once
_lingering = 0  # refused streams open now (see _send_refusal)


@dataclass(frozen=True)
class HandlerBound:
    """What one handler accepts: ``max_message_bytes`` per request message (the largest one the handler
    can use), ``max_streams_per_peer`` open at once from one caller, ``max_streams`` from all callers."""

    max_message_bytes: int
    max_streams_per_peer: int
    max_streams: int = MAX_STREAMS

    def __post_init__(self) -> None:
        if self.max_message_bytes <= 0 or self.max_streams_per_peer <= 0 or self.max_streams <= 0:
            raise ConfigError(f"a handler bound must be positive: {self}")


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
    """Open streams of one handler, per caller and in all; holds only callers with a stream open now."""

    def __init__(self, bound: HandlerBound):
        self.bound = bound
        self.open: Counter[str] = Counter()

    def enter(self, peer: str) -> str | None:
        if sum(self.open.values()) >= self.bound.max_streams:
            return f"this handler already serves {self.bound.max_streams} streams"
        if self.open[peer] >= self.bound.max_streams_per_peer:
            return f"{peer} already has {self.bound.max_streams_per_peer} streams open to this handler"
        self.open[peer] += 1
        return None

    def leave(self, peer: str) -> None:
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
    # How many streams of a handler may send replies at once over this peer's one uplink (the handler's own
    # cap); each reply's deadline allows for that share of a 1 Mbit/s uplink (``transfer_within_s``).
    reply_sharers: ClassVar[dict[str, int]] = {}
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
        """Why ``peer_id`` may not send to this servicer at all (asked before its first byte); None: it may.
        The default admits everyone: a servicer whose requests are small checks them in the handler."""
        return None

    def exempt(self, peer_id: str) -> bool:
        """Whether ``peer_id``'s streams skip the stream caps and admission: the coordinator's, where it
        must be able to ask whatever others hold open. The default exempts nobody."""
        return False

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
                reply = self.reply_bytes.get(handler.method_name, UNARY_MAX_BYTES)
                reply_within_s = transfer_within_s(reply * self.reply_sharers.get(handler.method_name, 1))
                serve = self._stream_handler(
                    p2p, name, method, handler.request_type, handler.stream_input, bound, reply_within_s
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
            peer = context.remote_id.to_base58()
            reason = slots.enter(peer)
            if reason is None and request.ByteSize() > bound.max_message_bytes:
                slots.leave(peer)
                reason = (
                    f"a request of {request.ByteSize()} bytes exceeds the limit of {bound.max_message_bytes}"
                )
            reason = reason or await self._admission_or_leave(peer, slots)
            if reason is not None:
                self._refuse(peer, context.handle_name, reason)
                raise ProtocolError(reason)
            try:
                return await method(request, context)
            finally:
                slots.leave(peer)

        return serve

    async def _admission_or_leave(self, peer: str, slots: _Slots) -> str | None:
        try:
            reason = await self.admission(peer)
        except BaseException:
            slots.leave(peer)
            raise
        if reason is not None:
            slots.leave(peer)
        return reason

    def _stream_handler(
        self, p2p: P2P, name: str, method: Callable, request_type: type[Message], stream_input: bool,
        bound: HandlerBound, reply_within_s: float,
    ) -> Callable:  # fmt: skip
        slots = _Slots(bound)

        async def serve(info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            peer = info.peer_id.to_base58()
            exempt = self.exempt(peer)
            with closing(writer):
                reason = None if exempt else slots.enter(peer) or await self._admission_or_leave(peer, slots)
                if reason is not None:
                    self._refuse(peer, name, reason)
                    await _send_refusal(reason, reader, writer)
                    return
                try:
                    context = P2PContext(handle_name=name, local_id=p2p.peer_id, remote_id=info.peer_id)
                    await self._pump(
                        reader, writer, request_type, bound, method, stream_input, context, reply_within_s
                    )
                finally:
                    if not exempt:
                        slots.leave(peer)

        return serve

    async def _pump(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request_type: type[Message],
        bound: HandlerBound, method: Callable, stream_input: bool, context: P2PContext,
        reply_within_s: float,
    ) -> None:  # fmt: skip
        """hivemind's ``_handle_stream`` with a bounded reader: requests are read ahead into a queue of
        ``MAX_PREFETCH`` while the handler answers, and a broken request ends the stream. Each reply must
        be written within ``reply_within_s``: a caller that stops reading ends the stream, and the
        handler's generator is closed at once (its ``finally`` frees what it held, such as an upload slot)."""
        requests: asyncio.Queue[Message | None] = asyncio.Queue(MAX_PREFETCH)

        async def incoming() -> AsyncIterator[Message]:
            while (request := await requests.get()) is not None:
                yield request

        async def answer() -> None:
            output = None
            try:
                source = incoming()
                output = method(source if stream_input else await _first(source), context)
                if not isinstance(output, AsyncIterator):
                    output = _single(output)
                async for response in output:
                    try:
                        await asyncio.wait_for(P2P.send_protobuf(response, writer), reply_within_s)
                    except asyncio.TimeoutError:
                        self._refuse(
                            context.remote_id.to_base58(), context.handle_name,
                            f"it read no reply for {reply_within_s:.0f}s",
                        )  # fmt: skip
                        return
                    except Exception:
                        return  # the caller closed the stream or it broke: the caller sees why
            except Exception as e:
                logger.warning(f"{context.handle_name} failed for {context.remote_id}: {e!r}")
                with suppress(Exception):
                    await P2P.send_protobuf(RPCError(message=str(e)), writer)
            finally:
                if isinstance(output, AsyncGenerator):
                    with suppress(Exception):
                        await output.aclose()

        processing = asyncio.create_task(answer())
        ended = False  # the caller's end of stream has been read
        first = True
        first_within_s = FIRST_REQUEST_TIMEOUT_S + bound.max_message_bytes / FIRST_REQUEST_MIN_BYTES_PER_S
        receiving: asyncio.Task | None = None
        try:
            while True:
                receiving = asyncio.create_task(
                    receive_bounded(reader, request_type, bound.max_message_bytes)
                )
                await asyncio.wait(
                    {processing, receiving}, return_when=asyncio.FIRST_COMPLETED,
                    timeout=first_within_s if first else None,
                )  # fmt: skip
                if first and not (processing.done() or receiving.done()):
                    receiving.cancel()
                    processing.cancel()
                    raise ProtocolError(f"no request arrived within {first_within_s:.0f}s")
                first = False
                if processing.done():
                    if not ended:
                        # The caller sends its end of stream after its request; a handler that answered
                        # first would close with it unread, and the reset overtook the replies (a
                        # validator saw BrokenPipeError from an honest holder and avoided it).
                        await asyncio.wait({receiving}, timeout=CLOSE_LINGER_S)
                    _discard(receiving)
                    return
                try:
                    request, _ = receiving.result()
                except (asyncio.IncompleteReadError, ConnectionError):
                    return  # the caller closed the stream or died
                ended = request is None
                queued = asyncio.create_task(requests.put(request))  # None: the caller's end of stream
                await asyncio.wait({processing, queued}, return_when=asyncio.FIRST_COMPLETED)
                if not queued.done():
                    # The handler returned with the read-ahead full: nothing reads the rest, and waiting
                    # to queue it held the stream and its slot until the process exited.
                    queued.cancel()
                    return
        except (ProtocolError, DecodeError) as e:
            self._refuse(context.remote_id.to_base58(), context.handle_name, str(e))
            await _send_refusal(str(e), reader, writer)
        finally:
            processing.cancel()
            if receiving is not None:  # this handler was cancelled while a read was pending
                _discard(receiving)


def _discard(task: asyncio.Task) -> None:
    """Cancel ``task``, or take the error it ended with: the caller's end of stream after the handler
    answered ends a read with ``IncompleteReadError``, which asyncio would otherwise log as never retrieved."""
    if not task.done():
        task.cancel()
    elif not task.cancelled():
        task.exception()


async def _send_refusal(reason: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Send ``reason`` and keep the stream open until the caller closes it, for at most
    ``CLOSE_LINGER_S``, dropping at most ``REFUSAL_DISCARD_BYTES`` of what it still sends. A socket
    closed with unread bytes in it is reset, and a reset can overtake the refusal, so the caller (often
    honest, say one past a stream cap) would see its call end with no reason given. A stream refused
    before it took a slot (a cap, admission) holds none while it lingers, so at most
    ``MAX_LINGERING_REFUSALS`` linger at once: a stranger opening streams as fast as it can gets its
    refusals closed at once, as before, and holds nothing. A bad request of an admitted stream lingers in
    its slot, up to ``CLOSE_LINGER_S`` more than it could hold it anyway."""
    global _lingering
    with suppress(Exception):
        await P2P.send_protobuf(RPCError(message=reason), writer)
    if _lingering >= MAX_LINGERING_REFUSALS:
        return
    _lingering += 1
    try:
        loop = asyncio.get_running_loop()
        deadline, discarded = loop.time() + CLOSE_LINGER_S, 0
        while discarded < REFUSAL_DISCARD_BYTES and (left := deadline - loop.time()) > 0:
            try:
                piece = await asyncio.wait_for(reader.read(REFUSAL_DISCARD_BYTES - discarded), left)
            except (asyncio.TimeoutError, ConnectionError):
                return
            if not piece:
                return
            discarded += len(piece)
    finally:
        _lingering -= 1


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


async def _first(requests: AsyncIterator[Message]) -> Message:
    async for request in requests:
        return request
    raise ProtocolError("the stream ended before its request")


async def _single(reply: Awaitable[Message]) -> AsyncIterator[Message]:
    yield await reply
