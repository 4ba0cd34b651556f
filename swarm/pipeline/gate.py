"""Who may call a stage server: verified members of the run that this server has not banned.

Membership is what the DHT shows: every admitted peer publishes its coordinator-signed certificate
(``swarm.membership``), and a peer the coordinator bans can no longer renew its admission, so its record
lapses. On top of that a server bans, for itself, a caller that keeps sending malformed requests.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter

import hivemind

from protocols import pipeline_pb2 as ppb
from protocols.keys import PublicKey
from swarm.membership import fetch_members

logger = logging.getLogger(__name__)


class PeerGate:
    """Admits callers. With a coordinator key it reads verified members from the DHT; without one (a
    run with no coordinator, as in benchmarks) only the peer IDs in ``allowed`` are members.

    Example::

        gate = PeerGate(dht, run.run_id, coordinator_key)
        refusal = await gate.check(caller)   # None, or (code, message)
    """

    def __init__(
        self,
        dht: hivemind.DHT | None,
        run_id: str,
        coordinator_key: PublicKey | None,
        *,
        allowed: set[str] | None = None,
        ban_after_bad_requests: int = 20,
        refresh_s: float = 1.0,
    ):
        self.dht, self.run_id, self.coordinator_key = dht, run_id, coordinator_key
        self.members: set[str] = set(allowed or ())
        self.banned: dict[str, str] = {}
        self.bad_requests: Counter[str] = Counter()
        self.ban_after_bad_requests, self.refresh_s = ban_after_bad_requests, refresh_s
        self._refreshed_at = -float("inf")
        self._lock = asyncio.Lock()

    def ban(self, peer_id: str, reason: str) -> None:
        if peer_id not in self.banned:
            logger.warning(f"banning {peer_id} from this stage server: {reason}")
        self.banned[peer_id] = reason

    def unban(self, peer_id: str) -> None:
        self.banned.pop(peer_id, None)
        self.bad_requests.pop(peer_id, None)

    def note_bad_request(self, peer_id: str, error: str) -> None:
        self.bad_requests[peer_id] += 1
        if self.bad_requests[peer_id] >= self.ban_after_bad_requests:
            self.ban(peer_id, f"{self.bad_requests[peer_id]} malformed requests, the last: {error}")

    async def _refresh(self) -> None:
        async with self._lock:
            if time.monotonic() - self._refreshed_at < self.refresh_s:
                return
            self._refreshed_at = time.monotonic()
            try:
                members = await fetch_members(self.dht, self.run_id, self.coordinator_key)
            except Exception as e:  # DHT trouble: keep the members we knew
                logger.debug(f"could not refresh the members of {self.run_id}: {e!r}")
                return
            self.members = set(members)

    async def check(self, peer_id: str) -> tuple[int, str] | None:
        """None if ``peer_id`` may call; else the refusal code and a message for the caller."""
        if peer_id in self.banned:
            return ppb.BANNED, f"peer {peer_id} is banned from this stage server: {self.banned[peer_id]}"
        if peer_id not in self.members and self.coordinator_key is not None and self.dht is not None:
            await self._refresh()
        if peer_id not in self.members:
            return ppb.UNKNOWN_PEER, (
                f"peer {peer_id} is not a member of run {self.run_id!r} (no valid certificate in the DHT)"
            )
        return None
