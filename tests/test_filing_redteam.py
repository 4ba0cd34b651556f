"""Findings of an attacker's read of how a validator files accusations, now regression tests (each failed
before its fix): a check that ends after the peer left files and keeps nothing, and only a sender check's
accusation waits out an earlier one (2 h at most); the others give up as before instead of piling up a
task and its evidence a round. In process only, reusing the helpers of
``tests/test_sendercheck_redteam.py``."""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import math
import threading
from types import SimpleNamespace

import pytest
import torch
from test_sendercheck_redteam import MEMBERS, REVEALS, STEP, _evidence, _numel, _round, _run, _state

import swarm.coordinator_client as coordinator_client
from protocols.errors import AccusationInFlight
from swarm.averaging.averager import Averager
from swarm.averaging.evidence import draw_seed
from swarm.coordinator_client import ACCUSE_IN_FLIGHT_WAIT_S, ACCUSE_RETRY_DELAYS_S, CoordinatorClient
from swarm.session import Session
from swarm.training.sendercheck import KIND as SENDER_CHECK
from swarm.training.sendercheck import SenderChecks, WrongContributionEvidence

pytestmark = pytest.mark.timeout(60)


def test_a_round_check_that_ends_after_close_files_nothing_and_keeps_nothing(monkeypatch):
    """Was LOW-MEDIUM. Attack: none needed beyond a liar caught near shutdown. ``TrainingPeer.shutdown`` calls
    ``SenderChecks.close()`` first, then awaits ``tiers.shutdown()`` (a data plane close) before the first
    tier's ``Averager.shutdown`` cancels its round checks. A round check whose replay (on a thread, up to
    ``JUDGING_BUDGET_S``) ends in that gap reaches ``_check_one`` after ``close()``: ``close`` only cancelled
    the filing that existed then and sets no closed flag, so a NEW ``_filing`` task starts, untracked by
    anyone (not in ``_verifications``), and runs ``accuse_until_taken`` for up to 2 h after the peer left
    (through a closed client channel or against a coordinator that lists the peer as left), keeping its
    state copy (a model and optimizer) with ``kept_until = inf`` and served by ``find`` all that while.
    Impact: a task and a full state copy leaked past shutdown (in a process that hosts several sessions
    or restarts a peer in process, for hours); accusations filed by a departed peer. Now ``close()`` also
    marks the checks closed: a check that ends later files nothing and keeps nothing (its liar is still
    avoided)."""
    run = _run("filing-after-close")
    tensors, hash_ = _state(run)
    lie = _evidence(run, torch.zeros(_numel(run)), hash_=hash_)
    started, release = threading.Event(), threading.Event()

    def slow_judge(self, *args, **kwargs):  # the replay of the round's drawn sender, on its thread
        started.set()
        release.wait(30)
        return "sent a contribution beyond the tolerance"

    monkeypatch.setattr(WrongContributionEvidence, "judge", slow_judge)
    accused_after_close = []
    closed = {"at": False}

    async def accuse(peer, evidence, verdict):  # accuse_until_taken: up to 2 h of AccusationInFlight
        accused_after_close.append(closed["at"])
        await asyncio.sleep(3600)

    checks = SenderChecks(run, device="cpu", state=lambda: (STEP, hash_, tensors), accuse=accuse)
    runner, outcome = _round(run, lie, draw_seed(lie.digest, REVEALS))

    async def scenario():
        await checks.keep(runner, [b"", lie.entry, b""])
        check = asyncio.create_task(checks.check(runner, [outcome]))
        await asyncio.to_thread(started.wait, 30)
        checks.close()  # TrainingPeer.shutdown: first thing
        closed["at"] = True
        release.set()  # the replay ends while tiers.shutdown() is awaited
        await check
        await asyncio.sleep(0.05)
        filing = checks.accusations._task
        leaked = filing is not None and not filing.done()
        served = checks.find(hash_)
        kept_forever = hash_ in checks.accusations.kept and math.isinf(
            checks.accusations.kept[hash_].kept_until
        )
        if filing is not None:
            filing.cancel()
            await asyncio.gather(filing, return_exceptions=True)
        return leaked, served, kept_forever

    leaked, served, kept_forever = asyncio.run(scenario())
    assert checks.caught == 1 and lie.accused == MEMBERS[1]
    assert not leaked and accused_after_close == [], "nothing is filed after close()"
    assert served is None and not kept_forever and hash_ not in checks.accusations.kept, (
        "and no state is kept"
    )


class _Clock:
    """Simulated time for asyncio.sleep: sleepers wake in order as the driver advances."""

    def __init__(self, real_sleep):
        self.now, self.seq, self.heap, self.real_sleep = 0.0, 0, [], real_sleep

    async def sleep(self, delay, result=None):
        if delay <= 0:
            await self.real_sleep(0)
            return result
        fut = asyncio.get_running_loop().create_future()
        self.seq += 1
        heapq.heappush(self.heap, (self.now + delay, self.seq, fut))
        await fut
        return result

    async def advance(self, to):
        while self.heap and self.heap[0][0] <= to:
            t, _, fut = heapq.heappop(self.heap)
            self.now = t
            if not fut.done():
                fut.set_result(None)
            for _ in range(3):
                await self.real_sleep(0)
        self.now = to
        for _ in range(3):
            await self.real_sleep(0)


def test_only_a_sender_checks_accusation_waits_out_an_earlier_one_the_others_never_pile_up(monkeypatch):
    """Was MEDIUM-LOW. Attack: a cheating reducer (or one that withholds an input from the validator and shows it to the
    coordinator, which bans nobody) whose validator's first accusation waits in the coordinator's judging
    queue (Sybils of a few addresses keep it long, docs/robustness.md). ``accuse_until_taken`` was changed
    for every caller, not only the sender check: the averager's ``_file_later`` (bad_aggregate and
    unshown_input evidence, one fire-and-forget task per round with no cap) now answers
    ``AccusationInFlight`` by asking again every 120 s for up to 2 h, where it gave up after the 465 s of
    ``ACCUSE_RETRY_DELAYS_S``. 7dd5f8f fixed this very pile-up for sender checks (one at a time) but
    the averager's accusations still pile up: one task a round, each holding its evidence (every
    sender's input to a chunk) for 2 h, ~16x more live tasks and evidence than before; and once the slot
    frees, each queued accusation is judged again in turn (bad_aggregate is not skipped for a convicted
    accused), each taking the validator's one slot and a recompute turn ahead of its sender check.
    Impact: validator memory grew with rounds x 2 h of evidence; the coordinator recomputed the same
    convicted reducer N times; the sender-check filing competed with N retrying tasks for the slot. Now
    ``accuse_until_taken`` waits out an earlier accusation only when asked to (``in_flight_wait_s``), which
    the session's accuser does for a sender check alone (filed one at a time, serving its state)."""
    clock = _Clock(asyncio.sleep)
    monkeypatch.setattr(coordinator_client.asyncio, "sleep", clock.sleep)
    attempts = []

    async def in_flight(key, run_id, *, accused, reason, evidence):  # the first one is still judged
        attempts.append(clock.now)
        raise AccusationInFlight("already has an accusation in flight; wait for its verdict")

    evidence = SimpleNamespace(to_bytes=lambda: bytes(1 << 20))  # ~1 MiB: every input to one chunk

    session = SimpleNamespace(key=None, run_config=SimpleNamespace(run_id="run"))
    accuse = Session.accuser(session)  # the session's accuser, as a volunteer's peer files with it

    averager = SimpleNamespace(accuse=accuse, _verifications=set())
    round_s = 30.0
    old_budget_s = sum(ACCUSE_RETRY_DELAYS_S)

    async def scenario():
        client = session.client = CoordinatorClient("127.0.0.1:1")
        client.accuse = in_flight
        alive = []
        for r in range(int(7200 / round_s)):  # a bad aggregate found every round for 2 h
            await clock.advance(r * round_s)
            await Averager._file_later(averager, "reducer", evidence, "bad aggregate")
            alive.append(len(averager._verifications))
        peak = max(alive)
        for task in list(averager._verifications):
            task.cancel()
        await asyncio.gather(*averager._verifications, return_exceptions=True)
        await client.close()
        return peak

    peak = asyncio.run(scenario())
    before = math.ceil(old_budget_s / round_s) + 1  # tasks alive at once, each giving up after 465 s
    assert peak <= before, (peak, before)
    assert len(attempts) <= 240 * (len(ACCUSE_RETRY_DELAYS_S) + 1)  # each tried 6 times, then given up
    # A sender check's accusation (one at a time) waits out the earlier one, asking every 120 s.
    attempts.clear()
    sender_check = SimpleNamespace(kind=SENDER_CHECK, to_bytes=lambda: b"evidence")

    async def patient() -> float:
        client = session.client = CoordinatorClient("127.0.0.1:1")
        client.accuse = in_flight
        filing = asyncio.create_task(accuse("liar", sender_check, "a lie"))
        for _ in range(200):
            await clock.advance(clock.now + 60.0)
            if filing.done():
                break
        with contextlib.suppress(AccusationInFlight):
            await filing
        await client.close()
        return clock.now

    asyncio.run(patient())
    assert ACCUSE_IN_FLIGHT_WAIT_S <= attempts[-1] - attempts[0] <= ACCUSE_IN_FLIGHT_WAIT_S + 600, attempts[
        -1
    ]
