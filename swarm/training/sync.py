"""Handing the training state from peer to peer, verified against a hash others agree on.

A peer that joins late, or finds itself behind or apart from the others, downloads the full state
(model, optimizer, step) from a peer that holds it and accepts it only if the bytes hash to the state
hash that the other peers (or the coordinator's signed checkpoint record) report for that step. A
download that fails its hash is discarded and the next candidate is tried.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import AsyncIterator as TypingAsyncIterator  # noqa: UP035 - hivemind reads typing hints

from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase

from protocols import averaging_pb2 as apb
from protocols.errors import NetworkError, ProtocolError, SwarmError
from swarm.training.state import DecodedState, decode_state

logger = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20


@dataclass(frozen=True)
class EncodedState:
    step: int
    state_hash: str
    data: bytes


# Returns this peer's current encoded state, or None when it has none to share.
StateProvider = Callable[[], Awaitable[EncodedState | None]]


def state_namespace(prefix: str) -> str:
    return f"{prefix.replace('.', '_')}_state"


class StateServicer(ServicerBase):
    """Serves this peer's state to peers that ask for it (hivemind finds ``rpc_*`` by annotations)."""

    def __init__(self, run_id: str, provider: StateProvider):
        self.run_id, self.provider = run_id, provider

    async def rpc_download_state(
        self, request: apb.StateRequest, context: P2PContext
    ) -> TypingAsyncIterator[apb.StateChunk]:
        state = await self.provider()
        if request.run_id != self.run_id:
            yield apb.StateChunk(error=f"this peer trains run {self.run_id!r}, not {request.run_id!r}")
            return
        if state is None or state.step < request.min_step:
            yield apb.StateChunk(error=f"no state at step {request.min_step} or later here")
            return
        logger.info(
            f"sending state of step {state.step} ({len(state.data) / 2**20:.1f} MiB) to {context.remote_id}"
        )
        for offset in range(0, max(len(state.data), 1), CHUNK_BYTES):
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
) -> DecodedState:
    """Fetch and verify ``peer``'s state; raises a SwarmError naming the peer and what was wrong."""
    stub = StateServicer.get_stub(p2p, peer, namespace=namespace)

    async def fetch() -> DecodedState:
        chunks: list[bytes] = []
        received = 0
        header: apb.StateChunk | None = None
        async for chunk in await stub.rpc_download_state(apb.StateRequest(run_id=run_id, min_step=min_step)):
            if chunk.error:
                raise ProtocolError(f"{peer} refused the state download: {chunk.error}")
            if header is None:
                header = chunk
                if header.state_hash != expected_hash:
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
