"""Who a peer averages with: certified by the coordinator, not banned, not caught breaking a group.

``PeerPolicy`` answers "may this peer be in a round with me?": it must hold a coordinator certificate
announced in the DHT (``swarm.membership``), not be on the coordinator's signed ban list
(``swarm.bans``), and not have been caught breaking a group recently (a suspect, avoided for
``suspect_s``). The ban state changes only through ``set_bans``/``refresh_bans``; readers get a frozen
copy. A policy with neither a coordinator key nor an allowed set admits everyone: that is a local
benchmark with no admission at all, never a volunteer.

Example::

    policy = PeerPolicy(dht, run.run_id, coordinator_key)
    await policy.refresh_bans()
    reason = policy.refusal(peer_id)   # None: may be in a round with this peer
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection, Iterable

import hivemind

from protocols.keys import PublicKey
from swarm.bans import fetch_ban_list
from swarm.membership import fetch_members

logger = logging.getLogger(__name__)

#: How long a refresh of the DHT's members may hold up a group check before the cached view answers.
MEMBERS_REFRESH_TIMEOUT_S = 2.0


class PeerPolicy:
    def __init__(
        self,
        dht: hivemind.DHT | None,
        run_id: str,
        coordinator_key: PublicKey | None = None,
        *,
        allowed: Iterable[str] | None = None,
        also_certified: Callable[[], Collection[str]] | None = None,
        refresh_s: float = 1.0,
        suspect_s: float = 60.0,
    ):
        """``also_certified`` names peers another verified source vouches for: the trainer's view of
        signed progress records, each of which carries its signer's certificate."""
        self.dht, self.run_id, self.coordinator_key = dht, run_id, coordinator_key
        self.refresh_s, self.suspect_s, self.also_certified = refresh_s, suspect_s, also_certified
        self.open = coordinator_key is None and allowed is None
        self._members: frozenset[str] = frozenset(allowed or ())
        self._banned: frozenset[str] = frozenset()
        self._bans_at = -float("inf")  # when the coordinator signed the list we hold
        self._suspects: dict[str, tuple[float, str, bool]] = {}  # peer -> (until, reason, as leader only)
        self._members_at = self._bans_checked_at = -float("inf")
        self._members_lock = asyncio.Lock()
        self._bans_lock = asyncio.Lock()

    # --- bans ----------------------------------------------------------------------------------------

    @property
    def banned(self) -> frozenset[str]:
        return self._banned

    def set_bans(self, banned: Iterable[str], issued_at: float) -> set[str]:
        """Take a ban list signed at ``issued_at`` unless a newer one is held; returns the newly banned."""
        if issued_at <= self._bans_at:
            return set()
        added = set(banned) - self._banned
        self._banned, self._bans_at = frozenset(banned), issued_at
        if added:
            logger.warning(f"the coordinator banned {sorted(added)}; refusing them in rounds and stages")
        return added

    async def refresh_bans(self) -> None:
        """Read the coordinator's newest signed ban list (at most once per ``refresh_s``)."""
        if self.coordinator_key is None or self.dht is None:
            return
        async with self._bans_lock:
            if time.monotonic() - self._bans_checked_at < self.refresh_s:
                return
            self._bans_checked_at = time.monotonic()
            try:
                found = await fetch_ban_list(self.dht, self.run_id, self.coordinator_key)
            except Exception as e:  # DHT trouble: keep the list we hold
                logger.debug(f"could not read the ban list of {self.run_id}: {e!r}")
                return
        if found is not None:
            self.set_bans(found[1], found[0])

    # --- members -------------------------------------------------------------------------------------

    def certified(self, peer_id: str) -> bool:
        if self.open or peer_id in self._members:
            return True
        return self.also_certified is not None and peer_id in self.also_certified()

    async def refresh_members(self) -> None:
        """Read the certified members from the DHT (at most once per ``refresh_s``); trouble keeps the old."""
        if self.coordinator_key is None or self.dht is None:
            return
        async with self._members_lock:
            if time.monotonic() - self._members_at < self.refresh_s:
                return
            self._members_at = time.monotonic()
            try:
                members = await fetch_members(self.dht, self.run_id, self.coordinator_key)
            except Exception as e:
                logger.debug(f"could not refresh the members of {self.run_id}: {e!r}")
                return
            self._members = frozenset(members)

    # --- suspects ------------------------------------------------------------------------------------

    def suspect(self, peer_id: str, reason: str, *, leader_only: bool = False) -> None:
        """Avoid ``peer_id`` in matchmaking for ``suspect_s``: it broke a group in a way nobody can prove.

        ``leader_only``: what it did only a leader can do (list a member twice, alter an entry), so it is
        not followed but may still join a group as a member, where the run may need it to reach its minimum.
        """
        self._suspects[peer_id] = (time.monotonic() + self.suspect_s, reason, leader_only)

    # --- the rule ------------------------------------------------------------------------------------

    def refusal(self, peer_id: str, *, as_leader: bool = False) -> str | None:
        """Why ``peer_id`` may not be in a round with this peer (``as_leader``: lead it), from what is
        known now; None if it may."""
        if peer_id in self._banned:
            return "banned by the coordinator"
        until, reason, leader_only = self._suspects.get(peer_id, (0.0, "", False))
        if until > time.monotonic() and (as_leader or not leader_only):
            return f"avoided{' as a leader' if leader_only else ''} for {until - time.monotonic():.0f}s more: {reason}"
        if until <= time.monotonic():
            self._suspects.pop(peer_id, None)
        if not self.certified(peer_id):
            return f"not a certified member of run {self.run_id!r} (no valid certificate in the DHT)"
        return None

    async def admit(self, peer_ids: Iterable[str], timeout_s: float = MEMBERS_REFRESH_TIMEOUT_S) -> None:
        """Refresh the members when any of ``peer_ids`` is not a known member yet, for at most ``timeout_s``."""
        if all(self.certified(p) for p in peer_ids):
            return
        try:
            await asyncio.wait_for(self.refresh_members(), timeout=timeout_s)
        except asyncio.TimeoutError:
            logger.debug("the members refresh took too long; using the members known so far")
