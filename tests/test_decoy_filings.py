"""Undecodable decoys beside a liar, in process: the real model, dataset, fp16 codec, signatures,
``SenderChecks`` and the coordinator's ``judge_contribution``, in the world of ``tests/ownpart.py`` (a group of
four, each member the reducer of its own part's one chunk, validators that practically never draw, so only
the reducers' own-part checks act).

A colluder's validly signed chunk that does not decode is refused by its reducer, which then never reads the
colluder's nonce and holds no shared draw. Two things followed from that: a validator filed one accusation at
a time, so the decoy's accusation (found first) kept the liar caught next in the same round from being filed
anywhere while the coordinator judged the decoy; and every reducer that refused the decoy replayed the whole
batch it claimed, so one identity that computed nothing cost each honest member of a group of four four of
its own steps, and in a group of 64 sixty-three replays. Now a caught liar waits its turn to be filed
(``SenderChecks._filings``), and a refused input is replayed by about ``OWN_PART_REPLAYERS`` reducers, by
each one's own randomness, as the shared draw would have named them (``SenderChecks._refused``).
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch
from ownpart import (
    LIAR,
    MEMBERS,
    STEP,
    WEIGHT,
    chunk_of,
    judge,
    make_world,
    one_round,
    reducer_holding,
    sender_checks,
    signed_input,
)

from lab.localswarm import tiny_run
from swarm.averaging.evidence import SignedInput
from swarm.training import sendercheck
from swarm.training.picks import OWN_PART_REPLAYERS
from swarm.training.sendercheck import SenderChecks, replays_own_part

pytestmark = pytest.mark.timeout(300)

RUN = tiny_run("decoy-filings", verify_probability=1e-9, sender_check_probability=1e-9)
DECOY = 3


@pytest.fixture(scope="module")
def world():
    return make_world(RUN)


def _nan_input(w, part: int, weight: float) -> SignedInput:
    """The decoy's validly signed chunk of ``part``: NaNs, which no codec decodes, for ``weight`` samples."""
    lo, hi = chunk_of(w, part)
    data = w.codec.encode_contribution(torch.full((hi - lo,), float("nan")))
    return signed_input(w, DECOY, part, data, weight=weight)


def _refusing_reducer(w, part: int, liar_sends: torch.Tensor | None, *, reversed_: int | None = None):
    """Reducer ``part`` after a round in which the decoy's input did not decode (it refused it, so it never
    read the decoy's nonce and holds no shared draw) and the liar sent ``liar_sends`` (None: honest); with
    ``reversed_`` that member sent its gradient reversed and the decoy sent nothing."""
    lo, hi = chunk_of(w, part)
    sent = {i: w.honest[i] for i in range(MEMBERS) if i != DECOY}
    if liar_sends is not None:
        sent[LIAR] = liar_sends
    if reversed_ is not None:
        sent[reversed_] = -w.honest[reversed_]
    inputs = [signed_input(w, i, part, w.codec.encode_contribution(v[lo:hi])) for i, v in sent.items()]
    decoded = [w.codec.decode_contribution(x.data, hi - lo, sender="x") for x in inputs]
    runner = reducer_holding(w, part, inputs, decoded, heard=set(range(MEMBERS)) - {DECOY})
    runner.reducer.undecodable = {} if reversed_ is not None else {DECOY: (0, _nan_input(w, part, WEIGHT))}
    return runner


def _check_with_a_slow_coordinator(w, runner) -> tuple[list[str], list[str], int]:
    """One round's sender checks at ``runner`` whose accusations the coordinator answers only after the
    round's checks are over (it downloads the state and replays first): (filed, suspected, lies caught)."""
    filed, suspected = [], []

    async def scenario() -> int:
        answered = asyncio.Event()

        async def accuse(peer, lie, verdict):
            filed.append(peer)
            await answered.wait()

        checks = SenderChecks(
            w.run, device="cpu", state=lambda: (STEP, w.hash, w.tensors), accuse=accuse,
            suspect=lambda peer, reason: suspected.append(peer),
        )  # fmt: skip
        await checks.keep(runner, w.entries)
        await checks.check(runner, [])
        caught = checks.caught
        assert filed == [w.members[DECOY]]  # the first accusation is in flight, the liar's waits its turn
        answered.set()
        await checks.filed()
        assert not checks.accusations.waiting and all(
            c.kept_until != float("inf") for c in checks.accusations.kept.values()
        )
        return caught

    return filed, suspected, asyncio.run(scenario())


def test_a_liar_caught_beside_an_undecodable_decoy_is_filed_after_it_however_long_the_decoy_is_judged(
    world, monkeypatch
):
    """The liar sends its reversed gradient (it stands out in every chunk); a colluder sends every reducer a
    validly signed NaN chunk. An honest reducer that replays both (its own randomness picks the refused
    input here) files the decoy first and the liar once the coordinator has answered the decoy: before,
    the liar was only avoided while the decoy was judged, and never filed anywhere."""
    w = world
    monkeypatch.setattr(sendercheck.os, "urandom", lambda n: bytes(n))  # the refused input is replayed
    for part in (0, 2):  # the honest reducers (the liar reduces part 1, the decoy part 3)
        filed, suspected, caught = _check_with_a_slow_coordinator(
            w, _refusing_reducer(w, part, -w.honest[LIAR])
        )
        assert caught == 2, caught
        assert set(suspected) == {w.members[DECOY], w.members[LIAR]}, suspected
        assert filed == [w.members[DECOY], w.members[LIAR]], filed


def test_the_coordinator_bans_the_decoy_on_a_reducers_evidence_without_a_draw(world, monkeypatch):
    """The decoy's evidence holds without a draw and the coordinator bans it: each round a decoy is used
    costs its sender its identity."""
    w = world
    monkeypatch.setattr(sendercheck.os, "urandom", lambda n: bytes(n))
    accused = []
    one_round(w, sender_checks(w, accused), _refusing_reducer(w, 0, -w.honest[LIAR]))
    lie = next(lie for peer, lie, _ in accused if peer == w.members[DECOY])
    found, guilty = judge(w, lie, w.members[0])
    assert guilty == w.members[DECOY], found


@pytest.mark.parametrize("members", [4, 64])
def test_a_refused_input_is_replayed_by_about_as_many_reducers_as_the_draw_names_whatever_the_group(members):
    """Without the shared draw each reducer that refused a decoy's input replays it with the share the
    draw would have named it with (``OWN_PART_REPLAYERS`` of the reducers other than the decoy): about 2
    replays of the batch the decoy claims, in a group of 4 or of 64, where before every reducer replayed it
    (3, or 63: a whole batch each, for one identity that computed nothing)."""
    item = object()
    runs = 400
    for index in (0, members - 1):
        runner = SimpleNamespace(
            index=index, members=[f"m{i}" for i in range(members)], reduces=lambda i: True,
            reducer=SimpleNamespace(undecodable={1: (0, item)}),
        )  # fmt: skip
        checks = SenderChecks(RUN, device="cpu", state=lambda: (0, "", {}))
        picked = sum(checks._refused(runner, b"", shared=False) == (0, item) for _ in range(runs))
        share = min(1.0, OWN_PART_REPLAYERS / (members - 1))
        assert abs(picked / runs - share) < 0.1, (members, picked)
    # the expected replays of one refused input in the whole group
    assert round((members - 1) * min(1.0, OWN_PART_REPLAYERS / (members - 1))) == OWN_PART_REPLAYERS


def test_a_peer_that_leaves_while_accusations_wait_their_turn_keeps_no_state_and_files_nothing_more(
    world, monkeypatch
):
    """The decoy's accusation is in flight and the liar's waits when the peer leaves (``close``): nothing more
    is filed and no state stays held or served for the waiting one (before, its copy stayed kept without
    end, ``find`` serving it after the peer left)."""
    w = world
    monkeypatch.setattr(sendercheck.os, "urandom", lambda n: bytes(n))
    filed = []

    async def scenario():
        never = asyncio.Event()

        async def accuse(peer, lie, verdict):  # the coordinator still judges
            filed.append(peer)
            await never.wait()

        checks = SenderChecks(w.run, device="cpu", state=lambda: (STEP, w.hash, w.tensors), accuse=accuse)
        runner = _refusing_reducer(w, 0, -w.honest[LIAR])
        await checks.keep(runner, w.entries)
        await checks.check(runner, [])
        assert [f.accused for f in checks.accusations.waiting] == [w.members[DECOY], w.members[LIAR]]
        checks.close()
        await checks.filed()
        return checks

    checks = asyncio.run(scenario())
    assert filed == [w.members[DECOY]] and not checks.accusations.waiting
    assert checks.find(w.hash) is None and not checks.accusations.kept


def test_accusations_on_one_state_share_one_copy_of_it(world, monkeypatch):
    """A round that completes and is not applied is retried at the same step and state, and each try copies
    the state; a lie filed in each of three tries held three copies of model and optimizer where the bound
    is two states. Accusations on one state now share the first one's copy."""
    w = world
    monkeypatch.setattr(sendercheck.os, "urandom", lambda n: bytes(n))

    def fresh_copy():  # as the trainer's: each read copies the state
        return STEP, w.hash, {k: v.clone() for k, v in w.tensors.items()}

    async def scenario():
        never = asyncio.Event()

        async def accuse(peer, lie, verdict):
            await never.wait()

        checks = SenderChecks(w.run, device="cpu", state=fresh_copy, accuse=accuse)
        # try 1: the decoy and the liar; try 2, at the same state: member 2 sends its gradient reversed
        for runner in (_refusing_reducer(w, 0, -w.honest[LIAR]), _refusing_reducer(w, 0, None, reversed_=2)):
            await checks.keep(runner, w.entries)
            await checks.check(runner, [])
        held = {id(f.copy.tensors) for f in checks.accusations.waiting} | {
            id(c.tensors) for c in checks.accusations.kept.values()
        }
        accused = [f.accused for f in checks.accusations.waiting]
        checks.close()
        return held, accused

    held, accused = asyncio.run(scenario())
    assert accused == [w.members[DECOY], w.members[LIAR], w.members[2]], accused
    assert len(held) == 1, len(held)


@pytest.mark.parametrize("shared", [True, False])
def test_a_decoys_false_weight_claim_takes_no_replay_from_a_liar_that_stands_out(world, shared):
    """A false weight claim is judged without a replay, and was picked first as the round's one sender to
    check for standing out: a decoy signing a weight no loop signs, beside a liar that stands out, left the
    liar unreplayed at the reducers checking both. Now the claim is filed and the round's stand-out replay
    still goes to the liar: both are filed, with the round's draw (at a reducer it names for both) or
    without it (the decoy withheld its nonce)."""
    w = world
    sent = {i: w.honest[i] for i in range(MEMBERS)}
    sent[LIAR] = -w.honest[LIAR]
    heard = set(range(MEMBERS)) if shared else set(range(MEMBERS)) - {DECOY}
    reducer = 0
    if shared:  # a reducer the world's fixed draw names to replay both
        probe = reducer_holding(w, 0, [], [], heard=heard)
        names = [set(replays_own_part(w.seed, probe, s)) for s in (LIAR, DECOY)]
        both = sorted((names[0] & names[1]) - {LIAR, DECOY})
        assert both, names
        reducer = both[0]
    lo, hi = chunk_of(w, reducer)
    inputs = [  # the decoy's signed for a million samples, a weight no loop signs
        signed_input(
            w, i, reducer, w.codec.encode_contribution(v[lo:hi]), weight=1e6 if i == DECOY else WEIGHT
        )
        for i, v in sent.items()
    ]
    runner = reducer_holding(w, reducer, inputs, [v[lo:hi] for v in sent.values()], heard=heard)
    accused = []
    one_round(w, sender_checks(w, accused), runner)
    assert sorted(peer for peer, _, _ in accused) == sorted([w.members[DECOY], w.members[LIAR]]), accused
