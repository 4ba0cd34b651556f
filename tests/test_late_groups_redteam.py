"""What an attacker's read of 434d9c9 (a late group adopts the step's combined round instead of forming its
own: ``SecondTier._combined_without``, ``SecondTier.adopt``, ``tiers.holds_the_step``) found, each now a
regression test that failed on it.

All run in-process with the real ``SecondTier``, ``TierCheck``, ``TierBoard``, ``fetch_tier_header`` and
``fetch_tier_result`` (where the timing matters) and ``TrainingPeer._adopt``; the network around them is
the stand-in of ``tests/test_tier_redteam.py`` (``make_tier``) and ``tests/test_late_groups.py``
(``_serving``). Two findings stay open (docs/scale.md): a member whose view does not yet show the peers
ahead adopts nothing and tries its step again, and records that are unchecked claims count in the
majority a round must hold, both ways.
"""

from __future__ import annotations

import asyncio
import contextlib
from types import SimpleNamespace

import pytest
import torch
from test_late_groups import _admitting, _headers, _searches, _serving
from test_tier_redteam import CODEC, MINE, NUMEL, certified, first_tier, handoff, make_tier
from test_tiers import PREFIX, SCHEMA, second_tier

from protocols import averaging_pb2 as apb
from protocols.keys import SigningKey
from swarm.averaging import tierserve
from swarm.averaging.allreduce import RoundResult
from swarm.averaging.matchmaking import FailedSearches
from swarm.averaging.tiers import TierCheck, covered_peers
from swarm.averaging.tierserve import TierBoard
from swarm.training import tiered
from swarm.training.catchup import Groupmates
from swarm.training.peer import TrainingPeer

pytestmark = pytest.mark.timeout(30)


def _timed_searches(calls):
    """A second-tier ``average`` that forms nothing and records (when, its window) of each search."""

    async def average(vector, weight, extra, *, failed_tries, window_s, **kwargs):
        calls.append((asyncio.get_running_loop().time(), window_s))
        return None

    return average


def _fast(tier, *, sender_timeout_s=0.05, averaging_timeout_s=0.2):
    """Shrink the stand-in averager's timeouts (the run's defaults are 5 s and 30 s: the same ratio of 1/6
    is kept, so every effect below scales by 100 to the defaults)."""
    tier.averager.sender_timeout_s = sender_timeout_s
    tier.averager.averaging_timeout_s = averaging_timeout_s
    tier.first.averaging_timeout_s = averaging_timeout_s
    return tier


class _Stream:
    """A holder's answer stream: each answer after its delay; then silence."""

    def __init__(self, answers):
        self.answers = list(answers)

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self.answers:
            await asyncio.sleep(3600)
        delay, answer = self.answers.pop(0)
        await asyncio.sleep(delay)
        return answer

    async def aclose(self):
        pass


def _holders(monkeypatch, answer_for):
    """Route the real ``tierserve.fetch_tier_result`` to stand-in holders: ``answer_for(peer)`` gives
    (delay before the stream opens, [(delay, answer), ...])."""
    asked = []

    class Stub:
        def __init__(self, peer):
            self.peer = peer

        async def rpc_tier_result(self, request):
            asked.append((asyncio.get_running_loop().time(), self.peer.to_base58()))
            open_delay, answers = answer_for(self.peer.to_base58())
            await asyncio.sleep(open_delay)
            return _Stream(answers)

    monkeypatch.setattr(
        tierserve.TierServicer, "get_stub", classmethod(lambda cls, p2p, peer, namespace=None: Stub(peer))
    )
    return asked


def _represent(tier, keys, group, rep, vector, *, ahead, here):
    return tier.combine(group, RoundResult(vector, True), me=keys[rep].peer_id, extra=MINE, fits=None,
                        peers_at_step=12, run_peers=12, ahead=ahead, here=here)  # fmt: skip


# --- 1. records a step ahead that hang cost a representative at most a sender timeout, never its window ----


def test_1_sybil_records_a_step_ahead_that_hang_cost_a_sender_timeout_not_the_second_tiers_window(
    monkeypatch,
):
    """HIGH on 434d9c9. 3 admitted Sybils publish records at step+1 every step and hold each tier stream
    open without answering. Every representative asked them one after the other before its search, each
    ask waiting out the open and the header (up to 12 sender timeouts: 60 s by default, the whole room
    ``second_window_s`` gives the search), so the window fell to the run's minimum and the step split.
    Now only headers are read, from all of them at once, within one sender timeout in all."""
    sybils = [SigningKey.generate().peer_id for _ in range(3)]
    asked = _holders(monkeypatch, lambda peer: (0.05, []))  # open the stream, then never answer

    async def scenario(ahead):
        keys, group, rep = first_tier(4)
        vector, calls = torch.randn(NUMEL), []
        tier = _fast(make_tier(keys, group, rep, vector, _timed_searches(calls)))
        start = asyncio.get_running_loop().time()
        await _represent(tier, keys, group, rep, vector, ahead=lambda: list(ahead), here=lambda: ())
        return [(at - start, window) for at, window in calls]

    honest = asyncio.run(scenario([]))
    attacked = asyncio.run(scenario(sybils))
    assert len(asked) >= 3, "every Sybil ahead is asked"
    started_s, window_s = attacked[0]
    assert started_s < 0.05 + 0.05, "the search starts within one sender timeout (5 s by default)"
    assert window_s >= honest[0][1] - 0.06, (
        "and its window still waits for groups that end their first tier later"
    )
    assert len(attacked) == len(honest) == 2, "records with nothing behind them stop no second try"


# --- 2. a holder that trickles the genuine round: the prefetch reads headers, an adoption ends in time ------


def test_2_a_holder_trickling_the_genuine_round_holds_nobody_past_its_members_wait(monkeypatch):
    """HIGH on 434d9c9. Sybil holders served the step's genuine round with each message just under its
    timeout and a corrupt last chunk: ``fetch_tier_result`` has no overall deadline, so the representative's
    prefetch lasted past its members' wait (``wait_s``), and an adopter's too. Now the representative reads
    the header alone (within a sender timeout) and an adoption ends within ``wait_s`` in all."""
    group_input = torch.randn(NUMEL)
    header, chunks, _ = second_tier(group_input=group_input, mine=MINE)
    probe = TierCheck(header, prefix=PREFIX, schema_hash=SCHEMA, numel=NUMEL, mine=MINE, representative=None,
                      contribution=None, weight=0.0, max_age_s=600.0, certify=None, refusal=None)  # fmt: skip
    held = covered_peers(probe.groups, lambda peer: True)
    bad = apb.PartChunk()
    bad.CopyFrom(chunks[-1])
    bad.data = CODEC.encode(torch.zeros(len(bad.data) // 2))
    step = 0.07  # each message inside its 0.1 s bound (2 x sender_timeout_s)
    trickled = [(step, header)] + [(step, apb.TierAnswer(chunk=c)) for c in [*chunks[:-1], bad] * 3]
    sybils = [SigningKey.generate().peer_id for _ in range(3)]
    _holders(monkeypatch, lambda peer: (step, list(trickled)))

    async def scenario():
        keys, group, rep = first_tier(4)
        vector, calls = torch.randn(NUMEL), []
        tier = _admitting(_fast(make_tier(keys, group, rep, vector, _timed_searches(calls))))
        loop = asyncio.get_running_loop()
        start = loop.time()
        await _represent(tier, keys, group, rep, vector, ahead=lambda: list(sybils), here=lambda: held)
        searched_s = calls[0][0] - start if calls else None
        start = loop.time()
        adopted = await tier.adopt(dict(MINE), sybils, showing=held)
        return searched_s, adopted, loop.time() - start, tier.wait_s

    searched_s, adopted, adopt_s, wait_s = asyncio.run(scenario())
    assert searched_s is not None and searched_s < 0.12, (
        "the representative searched after one sender timeout"
    )
    assert adopted is None and adopt_s < wait_s + 0.1, (
        f"the adoption gave up within the wait ({adopt_s:.2f} s)"
    )


# --- 3. outer_overlap: no adoption there, so no prefetch either ----------------------------------------------


def test_3_in_outer_overlap_a_late_group_searches_as_before():
    """MEDIUM on 434d9c9. ``TrainingPeer._round`` passed ``ahead`` whatever the strategy, so in a DiLoCo
    ``outer_overlap`` run a late group's representative skipped its search and told its members nothing,
    while ``_adopt`` does nothing under overlap: the whole group dropped the step. Now the peer passes no
    ``ahead`` there."""
    seen = {}

    async def average(vector, weight, extra, **kwargs):
        group = SimpleNamespace(peer_ids=["me", "h0", "h1", "h2"], extras=[extra] * 4, excluded=[])
        return group, RoundResult(vector, True)

    async def combine(group, result, *, ahead, **kwargs):
        seen["ahead"] = ahead

    def peer(overlap: bool):
        return SimpleNamespace(
            view={f"h{i}": SimpleNamespace(peer_id=f"h{i}", step=7) for i in range(3)}, peer_id="me", step=7, samples=32,
            config=SimpleNamespace(training=SimpleNamespace(min_group_size=2)),
            hooks=SimpleNamespace(contribute=lambda peer, v: v, weight=lambda w: w, entry=lambda e: e),
            strategy=SimpleNamespace(contribution=lambda s: torch.zeros(4), weight=lambda s: float(s), overlap=overlap),
            _own_contribution=lambda: torch.zeros(4),  # TrainingPeer._own_contribution, finite
            _round_extra=lambda: dict(MINE), averager=SimpleNamespace(average=average), _averaged=None,
            policy=SimpleNamespace(refusal=lambda p: None, member_count=lambda: 0, refresh_members=lambda: asyncio.sleep(0)),
            _searches=FailedSearches(), _stats={"last_round_s": 0.0, "averaging_s": 0.0, "rounds_failed": 0},
            _journal=lambda *a, **k: None, _adopt=lambda extra: asyncio.sleep(0, False), _group_usable=lambda g: True,
            tiers=SimpleNamespace(combine=combine), _ahead=lambda: ["ahead"], _showing=set,
            sender_checks=SimpleNamespace(enabled=False), groupmates=Groupmates(),
        )  # fmt: skip

    asyncio.run(TrainingPeer._round(peer(overlap=True)))
    assert seen["ahead"] is None, "no adoption under overlap, so nothing ahead to adopt from"
    asyncio.run(TrainingPeer._round(peer(overlap=False)))
    assert seen["ahead"]() == ["ahead"]


# --- 4. a round that lists the late group's own members ------------------------------------------------------


def test_4_a_sybil_round_that_lists_the_late_groups_own_members_is_not_the_steps(monkeypatch):
    """MEDIUM on 434d9c9. Six Sybil identities (one record, at step+1) certified two groups that list the
    late group's four members, who were provably in none of them (they just ran their own first tier):
    5 of the 7 peers the representative sees, so it skipped its search for the Sybils' round. Now its own
    group counts as in none of the round's groups: 1 of 7, and it searches."""
    keys, group, rep = first_tier(4)
    sybil = [SigningKey.generate() for _ in range(6)]
    evil = [torch.full((NUMEL,), 5.0), torch.full((NUMEL,), 7.0)]  # the Sybils' chosen update
    certs = {
        0: certified(sybil[0], 64.0, evil[0], cosigners=[sybil[1], sybil[2], keys[0], keys[1]], signers=3),
        1: certified(sybil[3], 64.0, evil[1], cosigners=[sybil[4], sybil[5], keys[2], keys[3]], signers=3),
    }
    header, _, _ = handoff(evil, keys=[sybil[0], sybil[3]], certs=certs)
    _headers(monkeypatch, header)
    honest_others = {SigningKey.generate().peer_id for _ in range(2)}

    async def scenario():
        calls, vector = [], torch.randn(NUMEL)
        tier = _admitting(make_tier(keys, group, rep, vector, _searches(calls)))
        await _represent(
            tier, keys, group, rep, vector, ahead=lambda: [sybil[0].peer_id], here=lambda: honest_others
        )
        return calls

    assert asyncio.run(scenario()), "it searched a second-tier round: the Sybils' round is not the step's"


# --- 5. certificates of a bare majority: one signer that no longer counts dropped a whole group ------------


def test_5_a_representative_keeps_the_attestations_that_come_soon_after_the_majority():
    """MEDIUM on 434d9c9. A certificate carried a bare majority (``TierBoard.majority`` returned at the first
    one), so one signer that an adopter no longer counts (it left, or let its records lapse on purpose)
    dropped its whole group out of the round's coverage, and the late group formed a second round. Now the
    representative takes the attestations that come within ``rest_s`` of the majority: a group of 3 whose
    third member attests a moment later certifies with all three, and one that never attests costs
    ``rest_s``, no more."""

    async def scenario():
        board = TierBoard()
        group_id, members = b"g" * 20, ["a", "b", "c"]
        board.open(group_id, members, holds=lambda member, signature: True)
        board.attest(group_id, "a", b"sa")
        board.attest(group_id, "b", b"sb")
        loop = asyncio.get_running_loop()
        loop.call_later(0.05, board.attest, group_id, "c", b"sc")
        full = await board.majority(group_id, timeout_s=5.0, rest_s=1.0)
        board.open(b"h" * 20, members, holds=lambda member, signature: True)
        board.attest(b"h" * 20, "a", b"sa")
        board.attest(b"h" * 20, "b", b"sb")
        start = loop.time()
        bare = await board.majority(b"h" * 20, timeout_s=5.0, rest_s=0.1)
        return full, bare, loop.time() - start

    full, bare, waited = asyncio.run(scenario())
    assert full == {0: b"sa", 1: b"sb", 2: b"sc"}, "the third attestation, a moment later, signs too"
    assert bare == {0: b"sa", 1: b"sb"} and 0.1 <= waited < 0.5, "a member that never attests costs rest_s"


# --- 7. peers two steps ahead count ---------------------------------------------------------------------------


def test_7_a_peer_that_the_run_left_two_steps_behind_does_not_adopt_a_round_of_sybil_identities(monkeypatch):
    """MEDIUM on 434d9c9. ``TrainingPeer._adopt`` counted only the peers at its step or the next, so a
    peer the run had left two steps behind saw one Sybil record at step+1 as most of the run, and adopted a
    round of five Sybil identities whose certificate listed it. Now every peer at its step or later
    counts."""
    victim = SigningKey.generate()
    sybil = [SigningKey.generate() for _ in range(2)]
    evil = [torch.full((NUMEL,), 3.0), torch.full((NUMEL,), 5.0)]
    certs = {0: certified(sybil[0], 64.0, evil[0], cosigners=[SigningKey.generate(), victim], signers=2)}
    header, chunks, _ = handoff(evil, keys=sybil, certs=certs)
    monkeypatch.setattr(tiered, "fetch_tier_result", _serving(header, chunks))
    step = MINE["step"]
    view = {f"honest-{i}": SimpleNamespace(peer_id=f"honest-{i}", step=step + 2) for i in range(20)}
    view[sybil[0].peer_id] = SimpleNamespace(peer_id=sybil[0].peer_id, step=step + 1)
    applied = []

    async def scenario():
        keys, group, rep = first_tier(4)
        tier = _admitting(make_tier(keys, group, rep, torch.randn(NUMEL), _searches([])))

        async def commit(new_step):
            peer.step = new_step

        peer = SimpleNamespace(
            strategy=SimpleNamespace(overlap=False), peer_id=victim.peer_id, step=step, view=view,
            policy=SimpleNamespace(refusal=lambda p: None), tiers=tier, synced=SimpleNamespace(lock=asyncio.Lock()),
            computing=contextlib.nullcontext, _apply_round=applied.append, _reset_accumulation=lambda: None,
            _commit=commit, _journal=lambda *a, **k: None, progress_view=SimpleNamespace(count=0), state_hash="x",
        )  # fmt: skip
        peer._ahead = lambda: TrainingPeer._ahead(peer)
        peer._showing = lambda: TrainingPeer._showing(peer)
        return await TrainingPeer._adopt(peer, dict(MINE)), peer.step

    adopted, now = asyncio.run(scenario())
    assert adopted is False and now == step and applied == [], "the Sybils' round holds 2 of 22: not adopted"
