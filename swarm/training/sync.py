"""Handing the training state from peer to peer, verified against a hash others agree on.

A peer that joins late, or finds itself behind or apart from the others, downloads the full state
(model, optimizer, step) from a peer that holds it and accepts it only if the bytes hash to the state
hash that the other peers (or the coordinator's signed checkpoint record) report for that step. A
download that fails its hash is discarded and the next candidate is tried.

A holder serves its state only to requesters its ``admit`` callback accepts (certified, unbanned
members of the run), through the peer's upload limiter (``--max-upload-mbps``), to at most
``MAX_UPLOADS`` requesters at once and ``MAX_UPLOADS_PER_PEER`` streams per requester.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import AsyncIterator as TypingAsyncIterator  # noqa: UP035 - hivemind reads typing hints
from typing import TypeVar

import hivemind
from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.p2p.p2p_daemon_bindings.control import P2PHandlerError
from hivemind.utils import get_dht_time

from protocols import averaging_pb2 as apb
from protocols.envelope import seal
from protocols.errors import NetworkError, ProtocolError, SwarmError
from protocols.keys import PublicKey, SigningKey
from protocols.messages import CHECKPOINT_RECORD, CheckpointRecordBody, parse_body
from swarm.inbound import SMALL_REQUEST_BYTES, BoundedServicer, HandlerBound
from swarm.ratelimit import RateLimiter
from swarm.records import LogOnce, open_run_record, record_key, record_ttl_s
from swarm.training.state import DecodedState, decode_state

logger = logging.getLogger(__name__)
T = TypeVar("T")

CHUNK_BYTES = 1 << 20
MAX_UPLOADS = 4  # state streams one holder serves at once; each is about 3x the parameter bytes
MAX_UPLOADS_PER_PEER = 1


class StateMovedOn(NetworkError):
    """The holder trained past the agreed step before the download started; ask again with a fresh view."""


# Why a holder refuses a requester whose signed progress record it has not read (yet): a peer that
# has just joined asks before the holders' next view shows it, which is expected, not a fault.
NOT_SEEN_YET = "has no valid signed progress record"


class RequesterNotSeen(NetworkError):
    """The holder has not read this peer's first signed progress record yet; ask again after a view."""


@dataclass(frozen=True)
class EncodedState:
    """A peer's full training state at ``step`` as served to downloaders: safetensors bytes and their hash."""

    step: int
    state_hash: str
    data: bytes


# Returns this peer's current encoded state, or None when it has none to share.
StateProvider = Callable[[], Awaitable[EncodedState | None]]
# Returns the state of this hash that this peer holds (its current one or one it kept), or None.
StateFinder = Callable[[str], Awaitable[EncodedState | None]]
# Why a requester (by peer ID) may not download this peer's state, or None when it may.
Admit = Callable[[str], Awaitable[str | None]]


def peer_id_of(peer_id: str) -> PeerID:
    """The libp2p peer ID named by ``peer_id``; ProtocolError (never ValueError) when it is malformed."""
    try:
        return PeerID.from_base58(peer_id)
    except (ValueError, TypeError):
        raise ProtocolError(f"{str(peer_id)[:64]!r} is not a peer ID") from None


def download_limit(tensor_bytes: int) -> int:
    """The most bytes a state download of ``tensor_bytes`` of tensors may carry: twice the tensors, and
    1 MiB for the safetensors header and metadata. A holder that sends more is cut off."""
    return 2 * tensor_bytes + (1 << 20)


async def from_any_holder(holders: list[str], fetch: Callable[[PeerID], Awaitable[T]], what: str) -> T | None:
    """``fetch`` from each of ``holders`` in random order until one succeeds: its result, or None. A holder
    that moved on to a later step, or whose state fails a check, is passed over with a log line naming it."""
    random.shuffle(holders)
    for holder in holders:
        try:
            return await fetch(peer_id_of(holder))
        except (StateMovedOn, RequesterNotSeen) as e:
            logger.info(f"{e}; will look again")
        except SwarmError as e:
            logger.warning(f"discarding {what} from {holder}: {e}")
    return None


async def _refusals_named(
    replies: AsyncIterator[apb.StateChunk], peer: PeerID
) -> AsyncIterator[apb.StateChunk]:
    """``replies``, with a refusal before the first byte (the holder's admission) raised as the SwarmError
    its reason names: ``RequesterNotSeen`` when the holder has not read this peer's record yet."""
    try:
        async for chunk in replies:
            yield chunk
    except P2PHandlerError as e:
        if NOT_SEEN_YET in str(e):
            raise RequesterNotSeen(f"{peer} has not read this peer's signed progress record yet") from None
        raise ProtocolError(f"{peer} refused the state download: {str(e)[:300]}") from None


def state_namespace(prefix: str) -> str:
    return f"{prefix.replace('.', '_')}_state"


class StateServicer(BoundedServicer):
    """Serves this peer's state to admitted peers that ask for it (hivemind finds ``rpc_*`` by annotations).
    The request is a run ID and a step, or a state hash: ``find`` looks that state up (without it, only
    the current state matches). A caller may hold a few streams so that the handler's own limits
    (``max_uploads_per_peer``) answer with a reason."""

    bounds = {
        "rpc_download_state": lambda self: HandlerBound(
            SMALL_REQUEST_BYTES, max(4, self.max_uploads_per_peer)
        )
    }
    reply_bytes = {"rpc_download_state": CHUNK_BYTES + SMALL_REQUEST_BYTES}  # a chunk and the first's header
    # Its uploads share the holder's uplink: a chunk may take MAX_UPLOADS times as long as alone.
    reply_sharers = {"rpc_download_state": MAX_UPLOADS}

    def __init__(
        self,
        run_id: str,
        provider: StateProvider,
        *,
        admit: Admit,
        upload_limiter: RateLimiter | None = None,
        max_uploads: int = MAX_UPLOADS,
        max_uploads_per_peer: int = MAX_UPLOADS_PER_PEER,
        find: StateFinder | None = None,
    ):
        self.run_id, self.provider, self.admit, self.upload_limiter = run_id, provider, admit, upload_limiter
        self.find = find
        self.max_uploads, self.max_uploads_per_peer = max_uploads, max_uploads_per_peer
        self.uploads: Counter[str] = Counter()
        self.refused = 0
        self._log = LogOnce()

    async def admission(self, peer_id: str) -> str | None:
        # Before the first byte, so that a stranger's silent streams hold no download slot; the handler
        # asks again (a view read since may differ) and answers with the reason.
        return await self.admit(peer_id)

    async def rpc_download_state(
        self, request: apb.StateRequest, context: P2PContext
    ) -> TypingAsyncIterator[apb.StateChunk]:
        requester = context.remote_id.to_base58()
        refusal = await self.admit(requester)
        if refusal is None and sum(self.uploads.values()) >= self.max_uploads:
            refusal = f"this peer already serves {self.max_uploads} state downloads; try another holder"
        elif refusal is None and self.uploads[requester] >= self.max_uploads_per_peer:
            refusal = f"{requester} already has {self.uploads[requester]} state downloads running here"
        if refusal is not None:
            self.refused += 1
            # A joiner asking before this peer's view shows it is expected on every resume.
            level = logging.INFO if NOT_SEEN_YET in refusal else logging.WARNING
            self._log.warning(f"a state request from {requester}", refusal, level=level)
            yield apb.StateChunk(error=refusal)
            return
        self.uploads[requester] += 1
        try:
            async for chunk in self._send(request, requester):
                yield chunk
        finally:
            self.uploads[requester] -= 1
            if self.uploads[requester] <= 0:
                del self.uploads[requester]

    async def _state(self, wanted: str) -> EncodedState | None:
        if self.find is not None:
            return await self.find(wanted)
        state = await self.provider()
        return state if state is not None and state.state_hash == wanted else None

    async def _send(self, request: apb.StateRequest, requester: str) -> TypingAsyncIterator[apb.StateChunk]:
        if request.run_id != self.run_id:
            yield apb.StateChunk(error=f"this peer trains run {self.run_id!r}, not {request.run_id[:80]!r}")
            return
        wanted = request.state_hash
        if wanted and not is_state_hash(wanted):
            yield apb.StateChunk(
                error=f"StateRequest field 'state_hash' {wanted[:80]!r} is not 64 hex digits"
            )
            return
        state = await (self._state(wanted) if wanted else self.provider())
        if wanted and (state is None or state.step != request.min_step):
            yield apb.StateChunk(
                error=f"no state of hash {wanted[:12]} at step {request.min_step} here (neither the current "
                "one nor one kept)"
            )
            return
        if state is None or state.step < request.min_step:
            yield apb.StateChunk(error=f"no state at step {request.min_step} or later here")
            return
        logger.info(f"sending state of step {state.step} ({len(state.data) / 2**20:.1f} MiB) to {requester}")
        for offset in range(0, max(len(state.data), 1), CHUNK_BYTES):
            if self.upload_limiter is not None:
                await self.upload_limiter.acquire(len(state.data[offset : offset + CHUNK_BYTES]))
            header = (
                {"step": state.step, "state_hash": state.state_hash, "total_bytes": len(state.data)}
                if offset == 0
                else {}
            )
            yield apb.StateChunk(data=state.data[offset : offset + CHUNK_BYTES], **header)


async def download_state(
    p2p: P2P,
    peer: PeerID,
    *,
    namespace: str,
    run_id: str,
    min_step: int,
    expected_hash: str,
    max_bytes: int,
    timeout_s: float,
    accept_newer: Callable[[int, str], Awaitable[bool]] | None = None,
    exact: bool = False,
) -> DecodedState:
    """Fetch and verify ``peer``'s state; raises a SwarmError naming the peer and what was wrong.

    A holder that has moved past ``min_step`` offers its newer state: without ``accept_newer`` that is a
    StateMovedOn at once; with it the download goes on, and the state is returned only if
    ``accept_newer(step, state_hash)`` (awaited once the bytes are in and verified) vouches for it.
    With ``exact`` the request names ``expected_hash`` and ``min_step``, and the holder sends that state
    even after it moved on (if it kept it) or refuses.
    """
    stub = StateServicer.get_stub(p2p, peer, namespace=namespace)
    request = apb.StateRequest(run_id=run_id, min_step=min_step, state_hash=expected_hash if exact else "")

    async def fetch() -> DecodedState:
        chunks: list[bytes] = []
        received = 0
        header: apb.StateChunk | None = None
        async for chunk in _refusals_named(await stub.rpc_download_state(request), peer):
            if chunk.error:
                if NOT_SEEN_YET in chunk.error:
                    raise RequesterNotSeen(f"{peer} has not read this peer's signed progress record yet")
                raise ProtocolError(f"{peer} refused the state download: {chunk.error}")
            if header is None:
                header = chunk
                newer = header.step > min_step and header.state_hash != expected_hash
                if newer and accept_newer is None:
                    raise StateMovedOn(f"{peer} has moved on to step {header.step}")
                if header.state_hash != expected_hash and not newer:
                    raise ProtocolError(
                        f"{peer} offers state {header.state_hash[:12]}, not the agreed {expected_hash[:12]}"
                    )
                if header.total_bytes > max_bytes:
                    raise ProtocolError(
                        f"{peer} offers {header.total_bytes} bytes of state; the limit is {max_bytes}"
                    )
            received += len(chunk.data)
            if received > header.total_bytes:
                raise ProtocolError(f"{peer} sent more state bytes than it announced")
            chunks.append(chunk.data)
        if header is None or received != header.total_bytes:
            raise ProtocolError(
                f"{peer} sent {received} of {header.total_bytes if header else '?'} state bytes"
            )
        decoded = await asyncio.to_thread(decode_state, b"".join(chunks), max_bytes=max_bytes)
        if decoded.step > min_step and (decoded.step, decoded.state_hash) == (header.step, header.state_hash):
            if decoded.state_hash == expected_hash or (
                accept_newer and await accept_newer(decoded.step, decoded.state_hash)
            ):
                return decoded
            raise StateMovedOn(f"{peer} has moved on to step {decoded.step}, which the others' records do not "
                               f"vouch for (yet)")  # fmt: skip
        if decoded.state_hash != expected_hash or decoded.step < min_step:
            raise ProtocolError(f"state from {peer} hashes to {decoded.state_hash[:12]} at step {decoded.step}, "
                                f"expected {expected_hash[:12]} at step {min_step} or later")  # fmt: skip
        return decoded

    try:
        return await asyncio.wait_for(fetch(), timeout=timeout_s)
    except asyncio.TimeoutError:
        raise NetworkError(f"state download from {peer} took longer than {timeout_s:.0f}s") from None
    except SwarmError:
        raise
    except Exception as e:  # libp2p stream errors carry no common base
        raise NetworkError(f"state download from {peer} failed: {e!r}") from None


def is_state_hash(value: str) -> bool:
    """Whether ``value`` is a state hash as ``swarm.training.state.state_hash`` writes it (64 hex digits)."""
    return len(value) == 64 and all(c in "0123456789abcdef" for c in value)


def checkpoint_key(run_id: str) -> str:
    return record_key(run_id, "checkpoint")


async def publish_checkpoint_record(
    dht: hivemind.DHT, key: SigningKey, run_id: str, *, step: int, state_hash: str, ttl_s: float
) -> bool:
    """Announce, signed by the coordinator, the latest checkpoint it can serve."""
    expiration = get_dht_time() + record_ttl_s("checkpoint", ttl_s)
    body = {"step": step, "state_hash": state_hash, "expires_at": expiration}
    record = seal(key, CHECKPOINT_RECORD, run_id, body)
    return bool(
        await dht.store(checkpoint_key(run_id), record, expiration_time=expiration, return_future=True)
    )


async def fetch_checkpoint_record(
    dht: hivemind.DHT, run_id: str, coordinator_key: PublicKey
) -> tuple[int, str] | None:
    """The (step, state hash) of the coordinator's latest checkpoint, if a validly signed record exists."""
    found = await dht.get(checkpoint_key(run_id), latest=True, return_future=True)
    if found is None:
        return None
    try:
        envelope = open_run_record("checkpoint", run_id, found.value, found.expiration_time, coordinator_key)
        body = parse_body(
            CheckpointRecordBody, envelope.body, sender=envelope.sender, what="checkpoint record"
        )
    except SwarmError as e:
        _checkpoint_log.warning("the checkpoint record in the DHT", str(e))
        return None
    return body.step, body.state_hash


_checkpoint_log = LogOnce()
