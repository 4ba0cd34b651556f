"""``RunMatchmaking``: hivemind's matchmaking held to the peer's ``PeerPolicy``, declaring with signed,
certified declarations (``declarations``) under one fixed key per averaging prefix, assembling early when
the caller's rule holds for the entries gathered (``closing_rule``); ``FailedSearches``:
how many searches at a step formed no group, which widens the next one's window
(``Averager.matchmaking_window_s``).

``Averager`` builds it. As leader it tells its followers the group that ``RoundHooks.announce_group``
returns: the group it assembled, but in a rehearsed attack on the group (``swarm.byzantine.group_attacks``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from hivemind.averaging.matchmaking import Matchmaking
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import get_dht_time

from protocols.errors import SwarmError
from swarm.averaging.declarations import SignedGroupKeyManager
from swarm.averaging.groups import GroupEntryBody, open_entry
from swarm.averaging.hooks import RoundHooks
from swarm.averaging.policy import PeerPolicy
from swarm.records import RecordSigner

logger = logging.getLogger(__name__)


class _Accepted(asyncio.Event):
    """hivemind's ``was_accepted_to_group``, remembering which leader accepted this peer (hivemind sets
    ``current_leader`` just before it sets the event, and clears both when the request ends)."""

    def __init__(self, matchmaking: Matchmaking):
        super().__init__()
        self.matchmaking, self.by = matchmaking, None

    def set(self) -> None:
        self.by = self.matchmaking.current_leader
        super().set()


class RunMatchmaking(Matchmaking):
    """hivemind's matchmaking that neither leads nor follows a peer its ``PeerPolicy`` refuses
    (uncertified, banned or suspect), and remembers who led the last group it was in.

    A leader that accepted this peer and then neither began the round nor disbanded its group by this
    peer's own expiration (plus the request timeout) is avoided as a leader (``leader_only``): an honest
    leader begins or disbands by its own expiration, which comes before its followers'. One certified
    peer that accepted everyone and never began held every search of every peer, at any window, and
    nobody suspected it (``tests/test_window_redteam.py``).
    """

    def __init__(
        self, p2p, schema_hash, dht, *, policy: PeerPolicy, signer: RecordSigner | None,
        hooks: RoundHooks | None = None, **kwargs,
    ):  # fmt: skip
        super().__init__(p2p, schema_hash, dht, **kwargs)
        self.policy = policy
        self.hooks = hooks if hooks is not None else RoundHooks()
        self.leader: PeerID | None = None
        self.was_accepted_to_group = _Accepted(self)
        # Set per search by its averager (``Averager.find_group``'s ``closes_when``): whether the followers so
        # far (``current_followers``) complete the group, so that it assembles now rather than at the window's end.
        self.full: Callable[[dict], bool] | None = None
        if signer is not None:  # the run's DHT nodes refuse hivemind's unsigned, uncertified declarations
            self.group_key_manager = SignedGroupKeyManager(
                dht, self._prefix, self.target_group_size, signer, run_id=policy.run_id,
                coordinator_key=policy.coordinator_key,
            )  # fmt: skip

    async def rpc_join_group(self, request, context):
        # Bounded well inside the follower's wait for our first answer.
        await self.policy.admit([context.remote_id.to_base58()], timeout_s=self.request_timeout / 2)
        async for message in super().rpc_join_group(request, context):
            yield message
            if message.code == averaging_pb2.ACCEPTED:
                # hivemind yields ACCEPTED holding its join lock, which assembling needs, and checks its target
                # size only after: a group assembled here is begun as a full one.
                await self._assemble_if_full()

    def _check_reasons_to_reject(self, request, context):
        reason = self.policy.refusal(context.remote_id.to_base58())
        if reason is not None:
            logger.debug(f"refusing {context.remote_id} as a follower: {reason}")
            return averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
        return super()._check_reasons_to_reject(request, context)

    async def _request_join_group(self, leader: PeerID):
        await self.policy.admit([leader.to_base58()], timeout_s=self.request_timeout)
        reason = self.policy.refusal(leader.to_base58(), as_leader=True)
        if reason is not None:
            logger.debug(f"not following {leader}: {reason}")
            return None
        self.was_accepted_to_group.by = None
        expires = self.get_request_expiration_time()
        group = await super()._request_join_group(leader)
        if (
            group is None
            and self.was_accepted_to_group.by == leader
            and get_dht_time() >= expires + self.request_timeout / 2
        ):
            self.policy.suspect(
                leader.to_base58(), "accepted this peer into its group, then never began the round",
                leader_only=True,
            )  # fmt: skip
        return group

    async def _assemble_if_full(self) -> None:
        full = self.full
        if full is None or self.assembled_group.done() or not self.is_looking_for_group:
            return
        if self.current_leader is not None or len(self.current_followers) + 1 < self.min_group_size:
            return
        try:
            complete = full(self.current_followers)
        except Exception as e:  # never with the entries' checks as they are: the window then runs its course
            logger.warning(f"could not tell whether the group is complete: {e!r}")
            return
        if complete:
            await self.leader_assemble_group()

    def widen(self, window_s: float, base_s: float) -> None:
        """Make the next search's window ``window_s`` (the run's is ``base_s``): hivemind keeps the window
        and the join request's timeout as attributes it reads per search."""
        self.min_matchmaking_time = window_s
        self.potential_leaders.min_matchmaking_time = window_s
        # A leader's first answer does not wait for its window, and a silent one holds this peer's join lock
        # (nobody can join it meanwhile) for this long: at most the run's own window, however wide this is.
        self.request_timeout = max(0.5, min(window_s, 2 * base_s) / 2)

    async def leader_assemble_group(self):
        self.leader = self.peer_id
        group = await super().leader_assemble_group()
        announced = self.hooks.announce_group(group, self.peer_id)
        if announced is not group:
            # Followers read the group from this future when they are told to begin.
            future = asyncio.get_running_loop().create_future()
            future.set_result(announced)
            self.assembled_group = future
        return group

    async def follower_assemble_group(self, leader: PeerID, msg):
        if self.assembled_group.done():
            # This search has ended: its step's wait ran out (and cancelled the group) while the leader's
            # BEGIN_ALLREDUCE was arriving, and the request that reads it was not stopped in time (Python
            # 3.11's ``asyncio.wait_for`` hands a message that arrives in the same turn as a cancellation
            # to the cancelled caller). hivemind asserts here; the request failed with an AssertionError
            # that the search's cleanup logged at ERROR. End it as the cancellation it is: the leader's
            # part streams to this peer are answered that it knows no such round, and repaired.
            logger.debug(f"leader {leader} began its round after this search ended; not joining it")
            raise asyncio.CancelledError
        self.leader = leader
        return await super().follower_assemble_group(leader, msg)


def closing_rule(
    closes_when: Callable[[dict[str, GroupEntryBody]], bool], *, prefix: str, schema_hash: bytes, signed: bool,
    max_age_s: float, limit: int,
) -> Callable[[dict], bool]:  # fmt: skip
    """``RunMatchmaking.full`` for one search: ``closes_when`` over the entries of the first ``limit``
    followers (peer ID -> entry), each opened under its follower's own key once per search (a follower that
    leaves and joins again sends the same signed entry); one that does not open is left out. What an entry
    claims beyond its signature is for ``closes_when`` to check before it counts it; the round's own check
    (``check_group``) excludes or blames as always."""
    opened: dict[str, GroupEntryBody | None] = {}

    def claim(peer_id: str, data: bytes) -> GroupEntryBody | None:
        try:
            return open_entry(
                data,
                peer_id=peer_id,
                prefix=prefix,
                schema_hash=schema_hash,
                signed=signed,
                max_age_s=max_age_s,
            )
        except SwarmError as e:
            logger.debug(f"not counting {peer_id}'s entry toward closing the window: {e}")
            return None

    def full(followers: dict) -> bool:
        claims = {}
        for peer, request in list(followers.items())[:limit]:
            name = peer.to_base58()
            if name not in opened:
                opened[name] = claim(name, request.gather)
            if opened[name] is not None:
                claims[name] = opened[name]
        return closes_when(claims)

    return full


class FailedSearches:
    """Consecutive searches that formed no group the run could use at one data-parallel step: one that did,
    or a new step, starts the count again. (Pipeline stage rounds do not count yet: their window stays the
    run's.)

    Example::

        searches = FailedSearches()
        outcome = await averager.average(..., failed_tries=searches.failed(step))
        searches.record(step, formed=outcome is not None and len(outcome[0].peer_ids) >= needed)
    """

    def __init__(self) -> None:
        self._step: int | None = None
        self._failed = 0

    def failed(self, step: int) -> int:
        return self._failed if step == self._step else 0

    def record(self, step: int, *, formed: bool) -> None:
        self._failed = 0 if formed else self.failed(step) + 1
        self._step = step


__all__ = ["FailedSearches", "RunMatchmaking", "closing_rule"]
