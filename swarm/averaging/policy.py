"""Who a peer averages with: certified by the coordinator, not banned, not caught breaking a group.

``PeerPolicy`` answers "may this peer be in a round with me?": it must hold a coordinator certificate
announced in the DHT (``swarm.membership``), not be on the coordinator's signed ban list
(``swarm.bans``), and not have been caught breaking a group recently (a suspect: ``Suspects``). The
ban state changes only through ``set_bans``/``refresh_bans``; readers get a frozen copy. Once a leader has
announced a group, its members are checked by what they signed instead (``listed_refusal``,
``certificate_refusal``: the certificate each entry carries), never by this peer's view of the DHT,
which an honest leader's may not match, nor by suspicion, which the other members may not share.

A suspect is avoided for ``suspect_s`` (60 s), doubled for each repeat offence that comes within
``REPEAT_WINDOW_S`` of its last avoid period ending, up to ``MAX_SUSPECT_S``; an offence reported while
the peer is still avoided is the same offence seen again and escalates nothing. At most ``MAX_SUSPECTS``
peers are remembered (the one whose last offence is oldest is forgotten first), so Sybils that take turns
cannot grow the map without bound, and each one of them that comes back to offend again waits longer.
A reducer that did not deliver its part or denied a round may only be slow, so it is kept in another book
that counts searches and rounds, not seconds (``missed.MissedRounds``, through ``blame_round``). A policy
with neither a coordinator key nor an allowed set admits everyone: that is a local benchmark with no
admission at all, never a volunteer.

Example::

    policy = PeerPolicy(dht, run.run_id, coordinator_key)
    await policy.refresh_bans()
    reason = policy.refusal(peer_id)   # None: may be in a round with this peer
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass

import hivemind

from protocols.errors import SwarmError
from protocols.keys import PublicKey
from swarm.averaging.missed import MissedRounds
from swarm.bans import fetch_ban_list
from swarm.membership import fetch_members
from swarm.records import check_record_certificate

logger = logging.getLogger(__name__)

#: How long a refresh of the DHT's members may hold up a group check before the cached view answers.
MEMBERS_REFRESH_TIMEOUT_S = 2.0
# How long after this peer first sees a ban a leader that lists the banned peer is at fault: a leader reads
# the coordinator's list (published every few seconds) at its own pace, and may not have it yet.
BAN_GRACE_S = 60.0
#: How long a first offender is avoided.
SUSPECT_S = 60.0
#: The longest a repeat offender is avoided at a time.
MAX_SUSPECT_S = 960.0
#: An offence within this long after the last avoid period ended counts as a repeat.
REPEAT_WINDOW_S = 600.0
#: How many suspects a peer remembers at most.
MAX_SUSPECTS = 4096
#: How many members' verified certificates a peer keeps beside its last read of the member records.
MAX_CERTIFIED_KEPT = 65536


@dataclass(frozen=True)
class Suspicion:
    """Why and until when a peer is avoided; ``strikes`` counts its offences in a row."""

    until: float
    reason: str
    leader_only: bool
    strikes: int


class Suspects:
    """The peers a member avoids for a while, bounded and escalating (see the module docstring)."""

    def __init__(
        self,
        suspect_s: float = SUSPECT_S,
        max_suspect_s: float = MAX_SUSPECT_S,
        repeat_window_s: float = REPEAT_WINDOW_S,
        max_suspects: int = MAX_SUSPECTS,
        clock: Callable[[], float] = time.monotonic,
    ):
        if not 0 < suspect_s <= max_suspect_s or repeat_window_s < 0 or max_suspects < 1:
            raise ValueError("need 0 < suspect_s <= max_suspect_s, repeat_window_s >= 0, max_suspects >= 1")
        self.suspect_s, self.max_suspect_s, self.repeat_window_s = suspect_s, max_suspect_s, repeat_window_s
        self.max_suspects, self.clock = max_suspects, clock
        self._held: OrderedDict[str, Suspicion] = OrderedDict()

    def __len__(self) -> int:
        return len(self._held)

    def get(self, peer_id: str) -> Suspicion | None:
        """What is held against ``peer_id``, expired or not; None if nothing."""
        return self._held.get(peer_id)

    def add(self, peer_id: str, reason: str, *, leader_only: bool = False) -> Suspicion:
        """Avoid ``peer_id`` (``leader_only``: only as a leader); returns what is now held against it."""
        now = self.clock()
        old = self._held.get(peer_id)
        if old is not None and old.until > now:
            if old.leader_only and not leader_only:  # now also avoided as a member, for the same span
                old = Suspicion(old.until, reason, False, old.strikes)
                self._held[peer_id] = old
            return old
        strikes = old.strikes + 1 if old is not None and now - old.until <= self.repeat_window_s else 1
        avoid_s = min(self.suspect_s * 2 ** min(strikes - 1, 32), self.max_suspect_s)
        held = Suspicion(now + avoid_s, reason, leader_only, strikes)
        self._held[peer_id] = held
        self._held.move_to_end(peer_id)
        while len(self._held) > self.max_suspects:
            self._held.popitem(last=False)
        return held

    def avoided(self, limit: int) -> list[str]:
        """Up to ``limit`` peers avoided now (as members or as leaders), the latest offence first."""
        now = self.clock()
        return [peer for peer, held in reversed(self._held.items()) if held.until > now][:limit]

    def refusal(self, peer_id: str, *, as_leader: bool = False) -> str | None:
        """Why ``peer_id`` is avoided now (``as_leader``: to be followed); None if it is not."""
        held = self._held.get(peer_id)
        if held is None:
            return None
        left_s = held.until - self.clock()
        if left_s <= -self.repeat_window_s:  # served its time long enough ago: a clean slate
            del self._held[peer_id]
            return None
        if left_s <= 0 or (held.leader_only and not as_leader):
            return None
        # Rounded up: a peer still avoided for 0.3 s is not "avoided for 0s more".
        return f"avoided{' as a leader' if held.leader_only else ''} for {math.ceil(left_s)}s more: {held.reason}"


class PeerPolicy:
    """Whom this peer may average with: certified members of the run (from the DHT, or ``allowed``),
    not on the coordinator's signed ban list, and not a current suspect (``Suspects``).

    The one place that holds the ban list and the suspects of a peer: matchmaking, the averager's part
    streams and the trainer all ask ``refusal``; bans change only through ``set_bans``/``refresh_bans``
    and suspicions through ``suspect``/``blame_round``.

    Args:
        dht: the run's DHT, where member certificates and the ban list are read (None: nothing is read).
        run_id: the run whose members and bans count.
        coordinator_key: the key that signs certificates and ban lists; None with no ``allowed`` admits anyone.
        allowed: a fixed set of peer IDs to admit instead of reading certificates (tests, local runs).
        also_certified: peers another verified source vouches for (see ``__init__``).
        refresh_s: how often, at most, members and bans are read again.
        suspects: the suspect book to use (default: a fresh one with the module's spans).
        missed: the book of reducers that missed rounds (default: a fresh one).
    """

    def __init__(
        self,
        dht: hivemind.DHT | None,
        run_id: str,
        coordinator_key: PublicKey | None = None,
        *,
        allowed: Iterable[str] | None = None,
        also_certified: Callable[[], Collection[str]] | None = None,
        refresh_s: float = 1.0,
        suspects: Suspects | None = None,
        missed: MissedRounds | None = None,
    ):
        """``also_certified`` names peers another verified source vouches for: the trainer's view of
        signed progress records, each of which carries its signer's certificate."""
        self.dht, self.run_id, self.coordinator_key = dht, run_id, coordinator_key
        self.refresh_s, self.also_certified = refresh_s, also_certified
        self.open = coordinator_key is None and allowed is None
        self._members: frozenset[str] = frozenset(allowed or ())
        # Members whose certificate this peer verified (in a read of the member records, or in a groupmate's
        # signed entry) -> when it expires: a later read that misses a record (a partial DHT answer under
        # load, a refresh that timed out) does not make a certified groupmate a stranger before its
        # certificate ends (bans still apply). At most ``MAX_CERTIFIED_KEPT`` (``_certify``).
        self._certified_until: OrderedDict[str, float] = OrderedDict()
        self._banned: frozenset[str] = frozenset()
        self._banned_since: dict[str, float] = {}  # when this peer first saw each ban it holds
        self._bans_at = -float("inf")  # when the coordinator signed the list we hold
        self.suspects = suspects if suspects is not None else Suspects()
        self.missed = missed if missed is not None else MissedRounds()
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
        now = time.monotonic()
        self._banned_since = {p: self._banned_since.get(p, now) for p in self._banned}
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

    @property
    def judge(self) -> str | None:
        """The coordinator's peer ID: it may ask for a recent round's inputs (``serve_inputs``)."""
        return None if self.coordinator_key is None else self.coordinator_key.peer_id

    def certified(self, peer_id: str) -> bool:
        if self.open or peer_id in self._members:
            return True
        if self._certified_until.get(peer_id, -math.inf) > time.time():
            return True
        return self.also_certified is not None and peer_id in self.also_certified()

    def member_count(self) -> int:
        """The certified members in this peer's last read of the run's member records, banned ones left out
        (online peers, whatever their step; a record outlives its peer by up to its expiry)."""
        return len(self._members - self.banned)

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
            self._forget_expired()
            for peer_id, certificate in members.items():  # each verified unexpired by ``fetch_members``
                self._certify(peer_id, certificate.expires_at)

    # --- suspects ------------------------------------------------------------------------------------

    def suspect(self, peer_id: str, reason: str, *, leader_only: bool = False) -> None:
        """Avoid ``peer_id`` in matchmaking for a while: it broke a group in a way nobody can prove.

        ``leader_only``: what it did only a leader can do (list a member twice, alter an entry, list a
        peer that knows no such round), so it is not followed but may still join a group as a member,
        where the run may need it to reach its minimum.
        """
        before = self.suspects.get(peer_id)
        held = self.suspects.add(peer_id, reason, leader_only=leader_only)
        if held is not before:
            logger.info(
                f"avoiding {peer_id}{' as a leader' if held.leader_only else ''} for "
                f"{held.until - self.suspects.clock():.0f}s (offence {held.strikes}): {reason}"
            )

    def search_counted(self) -> None:
        """A search of this peer ended that counts toward ``missed``'s spans (it ran a round or waited
        out the run's window: ``Averager.average``)."""
        self.missed.search()

    def blame_round(
        self, failed: Iterable[str], denied: Iterable[str], *, delivered: Iterable[str] = ()
    ) -> None:
        """Keep account of the reducers of a round of this peer: one that took it and did not deliver
        (``failed``) or said it knows no such round (``denied``) missed it, one that ``delivered`` its part
        did not (``missed.MissedRounds``: a miss avoids it for searches, delivered rounds forgive it; a
        denial, which a leader can provoke, only for the next search).

        A denier was listed with its own signed, fresh entry in a group every member checked
        (``groups.check_group``), so it joined and then walked away (or left a group the others kept): the
        fault is its own, not the leader's, and its part is repaired like a withheld one (``repair``). Either
        may also be an honest peer on a loaded machine that missed the deadline or gave up on the round,
        which only the rate of its misses tells apart.
        """
        missed = {p: "did not deliver its part of a round" for p in failed}
        said = {p: "was in the group with its signed entry, then said it knows no such round" for p in denied}
        for peer, strikes, span in self.missed.round(delivered=delivered, missed=missed, denied=said):
            logger.info(
                f"avoiding {peer} for {span} search{'es' if span > 1 else ''} (strikes {strikes}): "
                f"{missed.get(peer) or said[peer]}"
            )

    def avoided(self, limit: int) -> list[str]:
        """Up to ``limit`` peers this peer avoids now (suspects first), for its heartbeat."""
        return list(dict.fromkeys(self.suspects.avoided(limit) + self.missed.avoided(limit)))[:limit]

    # --- the rule ------------------------------------------------------------------------------------

    def refusal(self, peer_id: str, *, as_leader: bool = False) -> str | None:
        """Why ``peer_id`` may not be in a round with this peer (``as_leader``: lead it), from what is
        known now; None if it may."""
        if peer_id in self._banned:
            return "banned by the coordinator"
        reason = self.suspects.refusal(peer_id, as_leader=as_leader) or self.missed.refusal(peer_id)
        if reason is not None:
            return reason
        if not self.certified(peer_id):
            return f"not a certified member of run {self.run_id!r} (no valid certificate in the DHT)"
        return None

    def listed_refusal(self, peer_id: str) -> str | None:
        """Why a member a leader listed may not be in the round, before its entry is opened: banned, or, in
        a run without a coordinator, not one of the allowed peers. In a coordinated run its entry carries
        its certificate (``certificate_refusal``), so this peer's view of the DHT is not asked."""
        if peer_id in self._banned:
            return "banned by the coordinator"
        if self.coordinator_key is None and not self.certified(peer_id):
            return f"not a member of run {self.run_id!r}"
        return None

    def leader_at_fault(self, peer_id: str) -> bool:
        """Whether a leader that listed ``peer_id`` (refused by ``listed_refusal``) must have known better:
        for a ban, once this peer has held it for ``BAN_GRACE_S``; a fixed member set never lags."""
        since = self._banned_since.get(peer_id)
        return since is None or time.monotonic() - since > BAN_GRACE_S

    def certificate_refusal(self, peer_id: str, certificate: bytes) -> str | None:
        """Why ``certificate`` (from ``peer_id``'s signed group entry) does not prove it a member of the
        run now; None if it does, or if the run has no coordinator."""
        if self.coordinator_key is None:
            return None
        now = time.time()
        try:
            verified = check_record_certificate(
                certificate, self.coordinator_key, self.run_id, peer_id=peer_id, expires_at=now, now=now
            )
        except SwarmError as e:
            return str(e)
        self._certify(peer_id, verified.expires_at)  # a groupmate's requests after the round are a member's
        return None

    def _certify(self, peer_id: str, expires_at: float) -> None:
        """Keep ``peer_id`` certified until ``expires_at``, as the most recently verified: past
        ``MAX_CERTIFIED_KEPT`` the expired go, then the least recently verified (a groupmate checked in
        this round is always kept)."""
        kept = self._certified_until
        kept[peer_id] = max(expires_at, kept.get(peer_id, 0.0))
        kept.move_to_end(peer_id)
        if len(kept) > MAX_CERTIFIED_KEPT:
            self._forget_expired()
            while len(kept) > MAX_CERTIFIED_KEPT:
                kept.popitem(last=False)

    def _forget_expired(self) -> None:
        now = time.time()
        for expired in [p for p, t in self._certified_until.items() if t <= now]:
            del self._certified_until[expired]

    async def admission(self, peer_id: str, timeout_s: float = MEMBERS_REFRESH_TIMEOUT_S) -> str | None:
        """Why ``peer_id`` may send this peer nothing at all (banned, or no certificate after a refresh of at
        most ``timeout_s``); None if it may. Suspicion is left to the round: a suspect is still certified."""
        if peer_id == self.judge:  # the coordinator demanding the inputs behind an aggregate
            return None
        await self.admit([peer_id], timeout_s=timeout_s)
        if peer_id in self._banned:
            return "banned by the coordinator"
        return None if self.certified(peer_id) else f"not a certified member of run {self.run_id!r}"

    async def admit(self, peer_ids: Iterable[str], timeout_s: float = MEMBERS_REFRESH_TIMEOUT_S) -> None:
        """Refresh the members when any of ``peer_ids`` is not a known member yet, for at most ``timeout_s``."""
        if all(self.certified(p) for p in peer_ids):
            return
        try:
            await asyncio.wait_for(self.refresh_members(), timeout=timeout_s)
        except asyncio.TimeoutError:
            logger.debug("the members refresh took too long; using the members known so far")
