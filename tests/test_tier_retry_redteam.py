"""What an attacker's read of e13f2ce found, each now a regression test that failed on it: a second-tier
representative whose search formed no round searches again with the same first-tier result while its
members' wait leaves room (``SecondTier._represent``), and applies its own result (``alone``) after
``ALONE_AFTER_TRIES`` searches.

All run in-process with the real ``SecondTier``; the network around it is the stand-in of
``tests/test_tier_redteam.py`` (``make_tier``: T = ``averaging_timeout_s`` = 0.2 s, members wait
``wait_s`` = 4T = 0.8 s, a window of 0.01 s). One ``average()`` of the real averager may take up to
``find_group``'s deadline, ``min(T, 3 * window + 2 s)``, plus its round's deadline (at least T): 0.4 s
here. With the run's defaults (T = 30 s, ``matchmaking_time_s`` = 2 s) the figures in the docstrings
follow from the same formulas.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from types import SimpleNamespace

import pytest
import torch
from test_tier_redteam import MINE, NUMEL, first_tier, make_tier, posted
from test_tiers import PREFIX, SCHEMA, second_tier

from protocols.keys import SigningKey
from swarm.averaging.allreduce import RoundResult, SignedOutput
from swarm.averaging.matchmaking import FailedSearches
from swarm.averaging.tiers import TierCheck, signed_peers
from swarm.training import tiered
from swarm.training.catchup import Groupmates
from swarm.training.peer import TrainingPeer
from swarm.training.tiered import ALONE_AFTER_TRIES

pytestmark = pytest.mark.timeout(30)


def _formed(keys, rep, combined, *, pause_s=0.0, signers=(0, 1), calls=None):
    """A stand-in ``average`` whose second-tier round forms with one other group and completes
    (``signers``: each part's signer; (0, 0) is a substitute's repair)."""

    async def average(vector, weight, extra, **kwargs):
        if calls is not None:
            calls.append(kwargs["failed_tries"])
        await asyncio.sleep(pause_s)
        tier_group = SimpleNamespace(group_id=os.urandom(20), peer_ids=[keys[rep].peer_id, "other"],
                                     weights=[64.0, 64.0], signed_entries=[b"e0", b"e1"], extras=[])  # fmt: skip
        return tier_group, RoundResult(combined, True, signed=SignedOutput(list(signers), [[], []]))

    return average


def _nobody(calls, pause_s=0.02):
    """A stand-in ``average`` whose search forms no round (nobody left at the tier-2 key at this step, or
    a tier-2 leader that accepted this representative and never began), after ``pause_s``."""

    async def average(vector, weight, extra, *, failed_tries, **kwargs):
        calls.append(failed_tries)
        await asyncio.sleep(pause_s)
        return None

    return average


# --- (a) HIGH: a group that misses the step's second-tier round now applies its own result ----------------


def test_a1_a_late_group_does_not_apply_its_own_result_while_the_others_applied_the_combined_one():
    """HIGH on e13f2ce (two updates at one step). The step's other groups G2, G3 formed
    their second-tier round without G1 (G1 finished its first tier after their window closed: load, or one
    admitted member of G1 dripping its first-tier part, or a tier-2 leader that held G1's representative
    once) and applied the combined result C. G1's representative then searches three times in a row with
    the same first-tier result; nobody is left at the step's tier-2 key, so after the third it says
    ``alone`` and all of G1 applies R_g: two updates at step 7, a state apart that catch-up's majority
    rule later moves back with a full download.

    Before e13f2ce the first failed search returned None, and ``TrainingPeer._round`` then adopted the
    combined result from the peers a step ahead (``_adopt``): one update. On e13f2ce ``combine`` did not
    return between searches, so nobody checked for peers ahead; ``alone`` comes after 3 windows (defaults:
    4 + 8 + 15 s of searching with nobody, ~27 s, bounded by ~70 s when held), where before it needed
    the same peer to be drawn representative 3 times at the step (between 3 and 2n+1 first-tier rounds in
    a group of n), each failure first offering the group adoption. Now the searches in one call stop before
    the last try, which comes only after the peer looked for peers ahead."""

    async def scenario():
        combined = torch.randn(NUMEL)
        # G2's representative: its round forms with G3 and completes; it applies C.
        keys2, group2, rep2 = first_tier(4)
        r2 = torch.randn(NUMEL)
        tier2 = make_tier(keys2, group2, rep2, r2, _formed(keys2, rep2, combined))
        applied2 = await tier2.combine(group2, RoundResult(r2, True), me=keys2[rep2].peer_id, extra=MINE,
                                       fits=None, peers_at_step=12, run_peers=12)  # fmt: skip
        # G1, later: nobody is left to meet at step 7.
        keys1, group1, rep1 = first_tier(4)
        r1, calls = torch.randn(NUMEL), []
        tier1 = make_tier(keys1, group1, rep1, r1, _nobody(calls))
        applied1 = await tier1.combine(group1, RoundResult(r1, True), me=keys1[rep1].peer_id, extra=MINE,
                                       fits=None, peers_at_step=12, run_peers=12)  # fmt: skip
        told = await posted(tier1, group1, keys1[(rep1 + 1) % 4].peer_id)
        return combined, applied2, r1, applied1, told, calls

    combined, applied2, r1, applied1, told, calls = asyncio.run(scenario())
    assert torch.equal(applied2.vector, combined), "G2 (and G3) applied the step's combined result"
    assert calls == [1, 2], "two searches, then back to the peer, which looks for peers ahead to adopt from"
    assert applied1 is None and told is None, "no second update at step 7: G1 applies nothing yet"


def test_a2_the_peer_adopts_from_peers_ahead_before_its_group_could_apply_its_own_result():
    """HIGH on e13f2ce (as a1, through ``TrainingPeer._round``). The peers a step ahead hold the step's
    combined result (``_adopt`` succeeds), yet the representative's ``combine`` returned G1's own result
    after its three searches, so ``_round`` applied R_g and never called ``_adopt``."""
    keys, group, rep = first_tier(4)
    vector, calls, adopted, applied = torch.randn(NUMEL), [], [], []
    tier = make_tier(keys, group, rep, vector, _nobody(calls))
    me = keys[rep].peer_id
    # Its groupmates' and another group's records still show step 7 when its first tier ends.
    others = [SimpleNamespace(peer_id=str(k.peer_id), step=7) for i, k in enumerate(keys) if i != rep]
    others += [SimpleNamespace(peer_id=f"g2-{i}", step=7) for i in range(4)]

    async def first(vector_, weight, extra, **kwargs):
        return group, RoundResult(vector, True)

    async def adopt(extra):
        adopted.append(extra)
        return True  # the peers ahead hold the combined result, and it checks

    async def commit(step):
        return None

    peer = SimpleNamespace(
        view={p.peer_id: p for p in others}, peer_id=me, step=7, samples=32,
        config=SimpleNamespace(training=SimpleNamespace(min_group_size=2, validation_every_steps=10**6)),
        hooks=SimpleNamespace(contribute=lambda peer, v: v, weight=lambda w: w, entry=lambda e: e),
        strategy=SimpleNamespace(contribution=lambda s: vector, weight=lambda s: float(s)),
        _own_contribution=lambda: vector,  # TrainingPeer._own_contribution, finite
        _round_extra=lambda: dict(MINE), averager=SimpleNamespace(average=first, last_form_s=0.0), _averaged=None,
        policy=SimpleNamespace(refusal=lambda p: None, member_count=lambda: 0, refresh_members=lambda: asyncio.sleep(0)),
        _searches=FailedSearches(),
        _stats={"last_round_s": 0.0, "averaging_s": 0.0, "rounds_failed": 0, "rounds_ok": 0, "train_loss": 5.0},
        _journal=lambda *a, **k: None, _adopt=adopt, _group_usable=lambda g: True, tiers=tier, _ahead=lambda: [],
        _showing=set,
        sender_checks=SimpleNamespace(enabled=False), synced=SimpleNamespace(lock=asyncio.Lock()),
        computing=contextlib.nullcontext, _apply_round=applied.append, _commit=commit, contributed_samples=0,
        groupmates=Groupmates(), witness=SimpleNamespace(record=lambda g: None),
        progress_view=SimpleNamespace(count=0), reached_max=lambda: False, state_hash=MINE["state_hash"],
        evaluate=lambda: asyncio.sleep(0),
    )  # fmt: skip
    asyncio.run(TrainingPeer._round(peer))
    assert calls == [1, 2]
    assert len(adopted) == 1, "asked the peers ahead"
    assert applied == [], "applied no result of its own group"


# --- (b) MEDIUM: the retry's room leaves out the search's deadline and its round ---------------------------


def test_b_no_retry_starts_that_could_end_after_the_members_gave_up():
    """MEDIUM on e13f2ce (members gave up while the representative still worked, and the group split). The
    loop searched again when ``now + matchmaking_window_s(failed + 1) <= give_up_at`` (``opened_at +
    wait_s - T``), but one ``average()`` may run its search up to ``min(T, 3 * window + 2 s)`` and then a
    round of at least T: the room reserved is one T, the retry may need 2T. Defaults: a retry may start at
    60 - 8 = 52 s, search to 78 s, round to 108 s; members stopped waiting at 90 s (3T then; 4T = 120 s now,
    with the same rule). A tier-2 leader that assembles late and a reducer that drips its part (or plain
    load) get there. Here search 1 ends with an incomplete round at 0.45 s (room by the old rule: 0.45 <=
    0.8 - T - window), search 2 would form late and complete at ~0.83 s > 0.8 s:
    the member's wait (``board.wait`` / ``fetch_down_the_tree``, ``wait_s``) has run out and it applies
    nothing, while the representative applies the combined result. Before e13f2ce the one search started
    after at most T of attestations and took at most 2T: inside the 3T wait. Now a retry needs room for a
    search and a round, 2T, before the members' wait ends."""
    pauses = iter([0.45, 0.38])

    async def scenario():
        keys, group, rep = first_tier(4)
        vector, combined = torch.randn(NUMEL), torch.randn(NUMEL)
        formed = _formed(keys, rep, combined)

        async def average(vector_, weight, extra, **kwargs):
            await asyncio.sleep(next(pauses))
            if kwargs["failed_tries"] == 1:  # a round formed but a reducer withheld: incomplete
                return SimpleNamespace(peer_ids=[]), RoundResult(vector_, False)
            return await formed(vector_, weight, extra, **kwargs)

        tier = make_tier(keys, group, rep, vector, average)
        asker = keys[(rep + 1) % 4].peer_id
        member = asyncio.create_task(
            tier.board.wait(group.group_id, asker, b"", open_s=0.1, timeout_s=tier.wait_s)
        )
        applied = await tier.combine(group, RoundResult(vector, True), me=keys[rep].peer_id, extra=MINE,
                                     fits=None, peers_at_step=12, run_peers=12)  # fmt: skip
        try:
            got = await member
        except asyncio.TimeoutError:
            got = "gave up"
        return applied, combined, got, tier.wait_s

    applied, combined, got, wait_s = asyncio.run(scenario())
    assert wait_s == pytest.approx(0.8)
    assert applied is None and got is None, "no retry: the representative and its members apply nothing alike"


# --- (e) LOW, pre-existing, now also ends the retry loop: a substituted round counts as formed --------------


def test_e_a_substituted_round_counts_as_a_failed_search():
    """LOW (older accounting, inside the retry loop on e13f2ce). A complete tier-2 round repaired by
    a substitute (a reducer that withheld its part) is recorded ``formed=True``: the loop stops although
    the members' wait leaves room and nobody applies that round (the group redoes its first tier, what the
    change meant to avoid), and the step's failed count drops to 0, so ``ALONE_AFTER_TRIES`` never comes:
    a certified tier-2 member that withholds its part whenever a target group is in the round (burning one
    suspected identity each time, every group of that round stalled alike) keeps the step from ever
    ending in ``alone``, and a group that had 2 failures starts over at the narrowest window. Now a round that
    nobody applies counts as a failed search."""

    async def scenario():
        keys, group, rep = first_tier(4)
        vector, calls = torch.randn(NUMEL), []
        me = keys[rep].peer_id
        tier = make_tier(keys, group, rep, vector, None)
        # Two searches at step 7 formed nothing, and the wait left no room for a third.
        tier._searches.record(MINE["step"], formed=False)
        tier._searches.record(MINE["step"], formed=False)
        tier.averager.average = _formed(keys, rep, torch.randn(NUMEL), signers=(0, 0), calls=calls)
        substituted = await tier.combine(group, RoundResult(vector, True), me=me, extra=MINE, fits=None,
                                         peers_at_step=12, run_peers=12)  # fmt: skip
        after = tier._searches.failed(MINE["step"])
        # The next first-tier round: nobody joins, yet it is the first failure again, not the third.
        group.group_id = os.urandom(20)
        tier.averager.average = _nobody(calls, pause_s=0.2)
        later = await tier.combine(group, RoundResult(vector, True), me=me, extra=MINE, fits=None,
                                   peers_at_step=12, run_peers=12)  # fmt: skip
        return substituted, after, later, calls

    substituted, after, later, calls = asyncio.run(scenario())
    assert substituted is None, "nobody applies a substituted round"
    assert calls[0] == ALONE_AFTER_TRIES, "it searched with its third (widest) window"
    assert after == ALONE_AFTER_TRIES, "and it counts as the step's third failed search"
    assert later is not None and calls[1:] == [ALONE_AFTER_TRIES + 1], "the next round ends the step alone"


def header_groups(header) -> list[dict]:
    """The group certificates a second-tier round's header carries (``TierCheck.groups``)."""
    check = TierCheck(header, prefix=PREFIX, schema_hash=SCHEMA, numel=NUMEL, mine=MINE, representative=None,
                      contribution=None, weight=0.0, max_age_s=60.0, certify=None, refusal=None)  # fmt: skip
    return check.groups


def test_a3_a_group_stops_searching_once_the_steps_round_shows_a_step_ahead(monkeypatch):
    """Once a peer a step ahead shows the step's combined round (the others combined without this group
    while it searched), the representative does not search again: its peers adopt what the others applied
    instead. Before its first search nobody ahead held one."""
    header, _, _ = second_tier(group_input=torch.randn(NUMEL), mine=MINE)
    held = signed_peers(header_groups(header), lambda peer: True)  # the 6 peers that signed, at step 8
    shown = []

    async def fetch_tier_header(p2p, holder, namespace, request, *, timeout_s, check):
        shown.append(holder)
        if len(shown) == 1:
            raise ConnectionError("nothing kept yet")
        return check(header)

    monkeypatch.setattr(tiered, "fetch_tier_header", fetch_tier_header)
    holder = SigningKey.generate().peer_id

    async def scenario():
        keys, group, rep = first_tier(4)
        vector, calls = torch.randn(NUMEL), []
        tier = make_tier(keys, group, rep, vector, _nobody(calls))
        tier.averager.policy.certified = lambda peer: True
        applied = await tier.combine(group, RoundResult(vector, True), me=keys[rep].peer_id, extra=MINE,
                                     fits=None, peers_at_step=12, run_peers=12, ahead=lambda: [holder],
                                     showing=lambda: held)  # fmt: skip
        return applied, calls

    applied, calls = asyncio.run(scenario())
    assert len(shown) == 2, "asked before the first search and after it"
    assert applied is None and calls == [1], "one search, then back to the peer to adopt"
