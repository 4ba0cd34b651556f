"""The coordinator's dial-back check: can other peers open a connection to this volunteer?

``swarm-peer doctor`` listens on the ports the peer will use and calls ``DialBack``; the coordinator
opens a plain TCP connection to the address the call came from (never any other address) on each
port and reports what happened. An address gets one check every ``MIN_INTERVAL_S`` over time, so the
service cannot be turned into a port scanner or a flood: ``BURST`` calls at once run at once (peers
behind one address that join together are checked without delay), a call past them waits for its
address's next slot, up to ``MAX_QUEUED`` slots ahead, and only a call past those is refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import time
from collections import OrderedDict

import grpc
from google.protobuf.message import DecodeError

from protocols import coordinator_pb2 as pb
from protocols.errors import NetworkError, ProtocolError, SwarmError, VersionMismatch
from protocols.version import PROTOCOL_VERSION
from swarm.rpc import ERROR_METADATA_KEY, status_code_for

logger = logging.getLogger(__name__)

SERVICE_NAME = "swarm.coordinator.v1.Coordinator"
MAX_PORTS = 4
DIAL_TIMEOUT_S = 3.0
MIN_INTERVAL_S = 2.0
BURST = 8  # calls per address that run at once: volunteers behind one address (a home, a lab, a sim) joining together
MAX_QUEUED = 2  # calls per address waiting for their slot; each waits at most MAX_QUEUED * MIN_INTERVAL_S
MAX_TRACKED_ADDRESSES = 10_000


def caller_host(peer: str) -> str:
    """The IP address in a grpc peer string (``ipv4:1.2.3.4:5``, ``ipv6:[::1]:5``)."""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        raise ProtocolError(f"dial-back needs a TCP caller, not {peer!r}")
    host = rest.rpartition(":")[0].strip("[]")
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        raise ProtocolError(f"cannot read the caller's address from {peer!r}") from None


async def dial(host: str, port: int, timeout_s: float = DIAL_TIMEOUT_S) -> pb.DialBackResult:
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout=timeout_s)
    except asyncio.TimeoutError:
        return pb.DialBackResult(port=port, reachable=False, detail=f"no answer within {timeout_s:.0f}s")
    except OSError as e:  # asyncio words a refusal as "Connect call failed"; the errno says why
        detail = os.strerror(e.errno) if e.errno else str(e)
        return pb.DialBackResult(port=port, reachable=False, detail=detail)
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return pb.DialBackResult(port=port, reachable=True)


class DialBackService:
    """The ``DialBack`` RPC (see the module docstring): one check per caller address every
    ``MIN_INTERVAL_S``, only to the address the call came from."""

    def __init__(self) -> None:
        self._last: OrderedDict[str, float] = OrderedDict()

    async def dial_back(self, request: pb.DialBackRequest, peer: str) -> pb.DialBackResponse:
        if request.header.protocol_version != PROTOCOL_VERSION:
            raise VersionMismatch(
                f"protocol version {request.header.protocol_version} is not supported; this coordinator "
                f"speaks {PROTOCOL_VERSION}: upgrade swarm"
            )
        ports = list(dict.fromkeys(request.ports))
        if not ports or len(ports) > MAX_PORTS or not all(0 < p < 65536 for p in ports):
            raise ProtocolError(
                f"dial-back takes 1 to {MAX_PORTS} ports in 1..65535, got {list(request.ports)}"
            )
        host = caller_host(peer)
        now = time.monotonic()
        # A rate of one per MIN_INTERVAL_S with bursts of BURST (GCRA): ``due`` is when the address's
        # allowance would be used up at that rate.
        due = max(now, self._last.get(host, now))
        wait_s = due - now - (BURST - 1) * MIN_INTERVAL_S
        if wait_s > MAX_QUEUED * MIN_INTERVAL_S:
            raise NetworkError(
                f"{BURST + MAX_QUEUED} dial-backs to {host} are already due in the next "
                f"{(MAX_QUEUED + 1) * MIN_INTERVAL_S:.0f}s; retry shortly"
            )
        self._last[host] = due + MIN_INTERVAL_S
        self._last.move_to_end(host)
        while len(self._last) > MAX_TRACKED_ADDRESSES:
            self._last.popitem(last=False)
        if wait_s > 0:
            await asyncio.sleep(wait_s)
        results = await asyncio.gather(*(dial(host, port) for port in ports))
        logger.info(
            f"dial-back to {host}: "
            + ", ".join(f"{r.port} {'open' if r.reachable else 'closed'}" for r in results)
        )
        return pb.DialBackResponse(address=host, results=results)

    def generic_handler(self) -> grpc.GenericRpcHandler:
        async def call(raw: bytes, context: grpc.aio.ServicerContext) -> pb.DialBackResponse:
            try:
                try:
                    request = pb.DialBackRequest.FromString(raw)
                except (DecodeError, RuntimeWarning) as e:
                    raise ProtocolError(f"malformed DialBackRequest: {e}") from None
                return await self.dial_back(request, context.peer())
            except SwarmError as e:
                logger.warning(f"refused DialBack from {context.peer()}: {e}")
                await context.abort(
                    status_code_for(e), str(e), trailing_metadata=((ERROR_METADATA_KEY, type(e).__name__),)
                )

        handler = grpc.unary_unary_rpc_method_handler(
            call, request_deserializer=None, response_serializer=lambda m: m.SerializeToString()
        )
        return grpc.method_handlers_generic_handler(SERVICE_NAME, {"DialBack": handler})
