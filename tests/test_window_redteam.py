"""Regression tests from an attacker's read of the widening matchmaking window (``FailedSearches`` in
``TrainingPeer._round`` -> ``Averager.find_group(failed_tries)`` -> ``matchmaking_window_s`` /
``RunMatchmaking.widen``) and of the matchmaking around it. Each failed on the code before its fix.

Everything runs in one process: the real ``Averager.find_group``, ``RunMatchmaking`` (hivemind's
``Matchmaking`` and ``PotentialLeaders``) and ``SignedGroupKeyManager`` (signed declarations, opened by
``open_declaration``), with the DHT replaced by an in-memory board every peer reads alike and libp2p's
join streams by in-memory streams whose handler runs in its own task (closing the stream cancels it,
as libp2p does).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from types import SimpleNamespace

import pytest
from hivemind.averaging.control import StepControl
from hivemind.p2p import PeerID, ServicerBase
from hivemind.proto import averaging_pb2
from hivemind.utils import MPFuture, get_dht_time

from lab.localswarm import tiny_run
from protocols.keys import SigningKey
from swarm.averaging.averager import Averager, GroupRound
from swarm.averaging.declarations import SignedGroupKeyManager
from swarm.averaging.matchmaking import RunMatchmaking
from swarm.averaging.policy import PeerPolicy
from swarm.records import RecordSigner
from swarm.training.progress import PeerProgress
from swarm.training.trainer import Trainer

pytestmark = pytest.mark.timeout(120)

RUN = "window-redteam"


# --- an in-process matchmaking cohort ------------------------------------------------------------------


class Board:
    """The DHT as every node sees it (key -> subkey -> (value, expiration)), and who answers join requests."""

    def __init__(self):
        self.entries: dict = {}
        self.handlers: dict = {}


class BoardDHT:
    """What ``SignedGroupKeyManager`` calls on a DHT: ``store`` (a later expiration replaces) and ``get``."""

    def __init__(self, board: Board, peer_id: PeerID):
        self.board, self.peer_id = board, peer_id

    async def store(self, key, subkey, value, expiration_time, return_future=True):
        entries = self.board.entries.setdefault(key, {})
        old = entries.get(subkey)
        if old is None or expiration_time >= old[1]:
            entries[subkey] = (value, expiration_time)
        return True

    async def get(self, key, latest=True, return_future=True):
        now = get_dht_time()
        found = {
            sk: SimpleNamespace(value=v, expiration_time=e)
            for sk, (v, e) in self.board.entries.get(key, {}).items()
            if e > now
        }
        return SimpleNamespace(value=found) if found else None


class Stream:
    """A server stream: the handler runs in its own task, as a libp2p handler does; closing cancels it."""

    def __init__(self, gen):
        self.queue: asyncio.Queue = asyncio.Queue()
        self.task = asyncio.create_task(self._pump(gen))

    async def _pump(self, gen):
        try:
            async for message in gen:
                self.queue.put_nowait(message)
        finally:
            self.queue.put_nowait(None)

    def __aiter__(self):
        return self

    async def __anext__(self):
        message = await self.queue.get()
        if message is None:
            raise StopAsyncIteration
        return message

    async def aclose(self):
        self.task.cancel()


def servicer_on(board: Board) -> type:
    class Stub:
        def __init__(self, caller: PeerID, peer: PeerID):
            self.caller, self.peer = caller, peer

        async def rpc_join_group(self, request):
            handler = board.handlers[self.peer]
            return Stream(handler(request, SimpleNamespace(remote_id=self.caller)))

    class BoardServicer(ServicerBase):
        @classmethod
        def get_stub(cls, p2p, peer, *, namespace=None):
            return Stub(p2p.peer_id, peer)

    return BoardServicer


def honest_averager(
    board: Board,
    key: SigningKey,
    allowed: list[str],
    *,
    matchmaking_time_s: float,
    averaging_timeout_s: float,
    matchmaking_type: type[RunMatchmaking] = RunMatchmaking,
    client_mode: bool = False,
) -> Averager:
    """An ``Averager`` as ``start`` builds it (same ``RunMatchmaking`` arguments), on the board."""
    pid = PeerID.from_base58(key.peer_id)
    dht = BoardDHT(board, pid)
    policy = PeerPolicy(None, RUN, allowed=allowed)  # every key here is a certified member
    averager = Averager(
        dht, prefix=RUN, numel=8, matchmaking_time_s=matchmaking_time_s, averaging_timeout_s=averaging_timeout_s,
        signing_key=key, policy=policy, data_plane=False,
    )  # fmt: skip
    averager.p2p = SimpleNamespace(peer_id=pid)
    averager.matchmaking = matchmaking_type(
        averager.p2p, averager.schema_hash, dht, servicer_type=servicer_on(board), prefix=averager.prefix,
        target_group_size=averager.max_group_size, min_group_size=2, min_matchmaking_time=matchmaking_time_s,
        request_timeout=max(0.5, matchmaking_time_s / 2), client_mode=client_mode, policy=policy,
        signer=averager.record_signer, hooks=averager.hooks,
    )  # fmt: skip
    board.handlers[pid] = averager.matchmaking.rpc_join_group
    return averager


class RogueLeader:
    """One certified peer. It keeps a signed declaration under the run's matchmaking key that expires
    soonest (so every honest searcher tries it first), renewed with a fresh expiration every ``every_s``
    (hivemind's ``past_attempts`` holds (peer, expiration) pairs, so each renewal is tried again). Asked
    to lead, it answers ACCEPTED and then nothing (``hold``), or nothing at all (``silent``)."""

    def __init__(self, board: Board, key: SigningKey, mode: str):
        self.key, self.mode = key, mode
        self.pid = PeerID.from_base58(key.peer_id)
        self.keys = SignedGroupKeyManager(
            BoardDHT(board, self.pid), RUN, None, RecordSigner(key), run_id=RUN, coordinator_key=None
        )
        self.requests = 0
        board.handlers[self.pid] = self.rpc_join_group

    async def rpc_join_group(self, request, context):
        self.requests += 1
        if self.mode == "hold":
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.ACCEPTED)
        await asyncio.Event().wait()  # never begins, never disbands, never redirects
        yield averaging_pb2.MessageFromLeader(code=averaging_pb2.GROUP_DISBANDED)

    async def declare_forever(self, ahead_s: float = 0.3, every_s: float = 0.05) -> None:
        key = self.keys.current_key
        while True:
            await self.keys.declare_averager(key, self.pid, get_dht_time() + ahead_s)
            await asyncio.sleep(every_s)


async def search_together(averagers: list[Averager], failed_tries: int, stagger_s: float = 0.2):
    """Every averager searches once at ``failed_tries`` (starting ``stagger_s`` apart, as peers of a
    loaded machine do), expecting all of them; [(outcome, seconds)]."""
    started = time.monotonic()

    async def one(i: int, averager: Averager):
        await asyncio.sleep(stagger_s * i)
        outcome = await averager.find_group(
            1.0, {"step": 0}, expected_size=len(averagers), failed_tries=failed_tries
        )
        return outcome, time.monotonic() - started

    return await asyncio.gather(*(one(i, a) for i, a in enumerate(averagers)))


@pytest.fixture(autouse=True)
def _mpfuture_backend():
    MPFuture()  # hivemind sets its future backend up on the first MPFuture (a peer's DHT does it first)


# --- 1. one certified peer fails every search, at every window -----------------------------------------


def test_one_certified_peer_that_accepts_and_never_begins_is_avoided_as_a_leader_and_the_group_forms():
    """hivemind's follower, once a leader answered ACCEPTED, pauses its search and waits for
    BEGIN_ALLREDUCE until its own declared expiration plus ``request_timeout`` (and a would-be leader
    that is accepted sends its own followers to that leader). A certified peer that declared the earliest
    expiration, accepted and never began held every honest searcher for a window and a half, was tried
    again at each fresh declaration and suspected by nobody: no group formed at any window (widening
    cannot escape holds that scale with it). Now a leader that accepted and let the follower's wait run
    out is avoided as a leader, and the honest peers form their group in the same search."""
    m, timeout = 1.0, 6.0
    keys = [SigningKey.generate() for _ in range(4)]
    allowed = [k.peer_id for k in keys]

    async def scenario(with_rogue: bool, failed_tries: int):
        board = Board()
        honest = [
            honest_averager(board, k, allowed, matchmaking_time_s=m, averaging_timeout_s=timeout)
            for k in keys[:3]
        ]
        rogue = RogueLeader(board, keys[3], "hold")
        declaring = asyncio.create_task(rogue.declare_forever()) if with_rogue else None
        await asyncio.sleep(0.2)
        try:
            outcomes = await search_together(honest, failed_tries)
        finally:
            if declaring is not None:
                declaring.cancel()
        suspected = [a.policy.refusal(rogue.key.peer_id, as_leader=True) for a in honest]
        return outcomes, rogue.requests, suspected, honest[0].matchmaking_window_s(failed_tries)

    # Control: without the rogue the three honest peers form one group of 3 at once.
    outcomes, _, _, _ = asyncio.run(scenario(False, 0))
    assert all(o is not None and len(o.peer_ids) == 3 for o, _ in outcomes)

    # The run's window (the first search of every step): the rogue holds its followers once, is avoided
    # as a leader by each of them, and the three honest peers form their group in the same search.
    outcomes, requests, suspected, window = asyncio.run(scenario(True, 0))
    assert window == m
    assert requests >= 1, "the rogue was followed once"
    assert all(o is not None and len(o.peer_ids) == 3 for o, _ in outcomes), outcomes
    assert any(reason is not None and "never began" in reason for reason in suspected), suspected


# --- 2. the join request's timeout widens with the window -----------------------------------------------


def test_a_silent_certified_leader_holds_a_follower_no_longer_than_the_runs_window_once_it_widened():
    """``RunMatchmaking.widen`` set ``request_timeout = max(0.5, window / 2)``, so what docs/protocol.md
    bounds a false or unanswered declaration to (one request timeout, the ``DeclarationBody.looking`` row)
    grew with failed searches to max(0.5, 4m), 1 s -> 7.5 s at the defaults, all of it holding hivemind's
    ``lock_request_join_group`` (a join request sent to the follower meanwhile is not looked at). A
    leader's first answer does not wait for its window: the timeout now stays within the run's
    ``matchmaking_time_s`` however wide the window."""
    m = 1.0
    keys = [SigningKey.generate() for _ in range(3)]
    allowed = [k.peer_id for k in keys]

    async def held_by_silent_leader(failed_tries: int) -> tuple[float, bool, bool, float]:
        board = Board()
        me = honest_averager(board, keys[0], allowed, matchmaking_time_s=m, averaging_timeout_s=30.0)
        other = honest_averager(board, keys[1], allowed, matchmaking_time_s=m, averaging_timeout_s=30.0)
        rogue = RogueLeader(board, keys[2], "silent")
        window = me.matchmaking_window_s(failed_tries)
        me.matchmaking.widen(window, m)  # what find_group does before every search
        mm = me.matchmaking
        now = get_dht_time()
        step = StepControl(
            scheduled_time=now + window, deadline=now + 3 * window + 2, allow_retries=False, weight=1.0,
            data_for_gather=b"entry",
        )  # fmt: skip
        step.attach(MPFuture(), MPFuture())
        step.allow_allreduce()
        async with mm.looking_for_group(step):
            mm.potential_leaders.declared_group_key = mm.group_key_manager.current_key
            mm.potential_leaders.declared_expiration_time = now + window
            started = time.monotonic()
            waiting = asyncio.create_task(mm._request_join_group(rogue.pid))
            await asyncio.sleep(0.3)
            locked = mm.lock_request_join_group.locked()
            # Another honest peer asks this one to lead meanwhile: its first answer waits for the lock.
            request = averaging_pb2.JoinRequest(
                schema_hash=me.schema_hash,
                expiration=now + 10 * window,
                group_key=mm.group_key_manager.current_key,
            )
            inbound = Stream(mm.rpc_join_group(request, SimpleNamespace(remote_id=other.p2p.peer_id)))
            first_answer = asyncio.create_task(inbound.__anext__())
            await asyncio.sleep(0.1)
            answered_meanwhile = first_answer.done()
            assert await waiting is None
            held = time.monotonic() - started
            first_answer.cancel()
            await inbound.aclose()
        suspected = me.policy.refusal(rogue.key.peer_id, as_leader=True) is not None
        return held, locked and not answered_meanwhile, suspected, mm.request_timeout

    held_0, blocked_0, suspected_0, timeout_0 = asyncio.run(held_by_silent_leader(0))
    held_3, blocked_3, suspected_3, timeout_3 = asyncio.run(held_by_silent_leader(3))
    assert (timeout_0, timeout_3) == (0.5, 1.0), "at most the run's window (1 s), not half of 8 s"
    assert held_0 == pytest.approx(0.5, abs=0.25)
    assert held_3 == pytest.approx(1.0, abs=0.3), "one unanswered join request costs no more than m"


# --- 3. a group too small for the run resets the count ---------------------------------------------------


def test_a_group_too_small_for_the_run_counts_as_no_group_so_the_window_keeps_widening():
    """``TrainingPeer._round`` recorded ``formed=outcome is not None``, so a group too small for the run
    (on a loaded machine a leader assembles whoever joined by its window's end; hivemind's minimum is 2)
    started the count again: with ``min_group_size`` >= 3 (every Byzantine-tolerant run, and swarm-sim's
    default) searches alternated no group / too small and the window never went past 2m."""
    key = SigningKey.generate()
    peer = Trainer(tiny_run(RUN, min_group_size=3), None, peer_id=key.peer_id, signing_key=key).peer
    others = [SigningKey.generate().peer_id for _ in range(2)]
    now = time.time()
    peer.view = {
        p: PeerProgress(p, 0, 8, 1.0, peer.state_hash, now) for p in [key.peer_id, *others]
    }  # fmt: skip
    small = GroupRound(
        b"g" * 16, [PeerID.from_base58(key.peer_id), PeerID.from_base58(others[0])], [8.0, 8.0],
        [{}, {}], [None, None],
    )  # fmt: skip
    outcomes = iter(
        [None, (small, SimpleNamespace(complete=True)), None, (small, SimpleNamespace(complete=True)), None]
    )
    asked: list[int] = []

    async def average(*args, failed_tries: int = 0, **kwargs):
        asked.append(failed_tries)
        return next(outcomes)

    peer.averager.average = average
    peer.samples = 8

    async def five_rounds():
        for _ in range(5):
            await peer._round()

    asyncio.run(five_rounds())
    assert peer.step == 0, "no round was applied"
    assert asked == [0, 1, 2, 3, 4], "a group too small for the run is no group: the count goes on"
    windows = [peer.averager.matchmaking_window_s(n) for n in asked]
    assert max(windows) > 2 * peer.config.training.matchmaking_time_s, "the window widens past double"


# --- 4. a leader begins as the follower's search ends --------------------------------------------------


class BeginsAsTheSearchEnds(RunMatchmaking):
    """A follower that gets its leader's BEGIN_ALLREDUCE in the same turn of the event loop as its own
    step's wait runs out. Python 3.11's ``asyncio.wait_for`` then returns the message to the request that
    the ending search cancels; here the request holds the message until then and swallows the
    cancellation as ``wait_for`` does, so the race that a loaded machine hits now and then happens every
    time."""

    async def follower_assemble_group(self, leader, msg):
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.shield(self.assembled_group)  # cancelled when the step's wait runs out
        return await super().follower_assemble_group(leader, msg)


def test_a_leader_that_begins_as_the_followers_search_ends_is_left_quietly_and_the_next_search_forms(caplog):
    """hivemind asserted that the search had not ended: the request failed with an AssertionError, which
    the search's cleanup logged at ERROR with its traceback (seen in the logs of loaded CI machines, read as
    a fault). Now the late BEGIN ends the request as the cancellation it is: the search returns no group
    with a debug line, and the next search of the same two peers forms their group."""
    m = 0.5
    keys = [SigningKey.generate() for _ in range(2)]
    allowed = [k.peer_id for k in keys]

    async def two_searches():
        board = Board()
        leader = honest_averager(board, keys[0], allowed, matchmaking_time_s=m, averaging_timeout_s=5.0)
        follower = honest_averager(
            board, keys[1], allowed, matchmaking_time_s=m, averaging_timeout_s=5.0,
            matchmaking_type=BeginsAsTheSearchEnds, client_mode=True,
        )  # fmt: skip
        first = await search_together([leader, follower], failed_tries=0, stagger_s=0.0)
        follower.matchmaking.__class__ = RunMatchmaking  # the next BEGIN comes in time
        second = await asyncio.wait_for(search_together([leader, follower], 0, stagger_s=0.0), 30)
        return first, second

    with caplog.at_level(logging.DEBUG, logger="swarm.averaging"):
        first, second = asyncio.run(two_searches())
    (led, _), (followed, _) = first
    assert led is not None and followed is None, "the leader began; the follower's search had ended"
    assert all(outcome is not None and len(outcome.peer_ids) == 2 for outcome, _ in second), second
    assert "began its round after this search ended" in caplog.text
    assert "AssertionError" not in caplog.text and not [
        r for r in caplog.records if r.levelno >= logging.ERROR
    ]
