"""Who may call a stage server: verified members of the run, not banned by the coordinator or by it.

Membership is what the DHT shows: every admitted peer publishes its coordinator-signed certificate
(``swarm.membership``). The coordinator's signed ban list (``swarm.bans``) is read through the same
``PeerPolicy`` the stage's averaging uses, so a banned trainer is refused at once rather than when its
certificate expires. On top of that a server bans, for itself, a caller that keeps sending malformed
requests.
"""

from __future__ import annotations

import logging
from collections import Counter

import hivemind

from protocols import pipeline_pb2 as ppb
from protocols.keys import PublicKey
from swarm.averaging.policy import PeerPolicy

logger = logging.getLogger(__name__)


class PeerGate:
    """Admits callers. With a coordinator key it reads verified members and the ban list from the DHT;
    without one (a run with no coordinator, as in benchmarks) only the peer IDs in ``allowed`` are
    members. ``policy`` shares that view with the stage's averager.

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
        policy: PeerPolicy | None = None,
    ):
        self.run_id = run_id
        if policy is None:  # no coordinator and no allowed set admits nobody, not everybody
            known = allowed if allowed is not None or coordinator_key is not None else set()
            policy = PeerPolicy(dht, run_id, coordinator_key, allowed=known, refresh_s=refresh_s)
        self.policy = policy
        self.banned: dict[str, str] = {}  # banned by this server, for malformed requests
        self.bad_requests: Counter[str] = Counter()
        self.ban_after_bad_requests = ban_after_bad_requests

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

    async def check(self, peer_id: str) -> tuple[int, str] | None:
        """None if ``peer_id`` may call; else the refusal code and a message for the caller."""
        if peer_id in self.banned:
            return ppb.BANNED, f"peer {peer_id} is banned from this stage server: {self.banned[peer_id]}"
        await self.policy.refresh_bans()
        if peer_id in self.policy.banned:
            return ppb.BANNED, f"peer {peer_id} is banned from run {self.run_id!r} by its coordinator"
        await self.policy.admit([peer_id])
        if not self.policy.certified(peer_id):
            return ppb.UNKNOWN_PEER, (
                f"peer {peer_id} is not a member of run {self.run_id!r} (no valid certificate in the DHT)"
            )
        return None
