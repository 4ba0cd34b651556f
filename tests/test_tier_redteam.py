"""Regression tests for the red-team findings against the second tier (``swarm.averaging.tiers``,
``tiercert``, ``tierserve``, ``swarm.training.tiered``), fixed in 563d3ae.

Each test performs an attack that succeeded before that commit and asserts that it now fails. All run
in-process with the real classes; the only stand-ins are the network around ``SecondTier`` (an averager
object with the attributes it reads) and a matchmaking outcome. Findings not fixed (a representative's
poisoned tier-2 input reaching other groups; an unchecked ``alone`` answer) have no test here.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import math
import os
import time
from types import SimpleNamespace

import pytest
import torch

from protocols import averaging_pb2 as apb
from protocols.errors import ProtocolError
from protocols.keys import SigningKey
from swarm.averaging.allreduce import RoundResult, SignedOutput, Traffic
from swarm.averaging.averager import GroupRound
from swarm.averaging.compression import get_codec
from swarm.averaging.evidence import (
    aggregate_message,
    chunk_bounds,
    input_entries,
    layout_chunk_values,
    reducer_mask,
    round_digest,
    split_bounds,
)
from swarm.averaging.groups import GroupEntryBody, make_entry
from swarm.averaging.matchmaking import FailedSearches
from swarm.averaging.missed import MissedRounds
from swarm.averaging.tiercert import certificate, result_digest, sign_attestation
from swarm.averaging.tiers import TIER_COMPRESSION, TierCheck, representative, tier_prefix
from swarm.averaging.tierserve import TierBoard, TierServicer
from swarm.training.catchup import Groupmates
from swarm.training.peer import TrainingPeer
from swarm.training.tiered import SecondTier

PREFIX = tier_prefix("run").replace(".", "_")
SCHEMA = hashlib.sha256(b"schema").digest()
NUMEL = 300
CODEC = get_codec(TIER_COMPRESSION)
MINE = {"step": 7, "state_hash": "ab" * 32}


def certified(key, weight, result, *, cosigners=None, signers=2, mine=MINE) -> dict:
    """A certificate for representative ``key`` of a group of 3 (itself, then ``cosigners`` or two fresh
    keys) whose result is ``result``, signed by the first ``signers`` of them."""
    group = [key, *(cosigners or [SigningKey.generate() for _ in range(2)])]
    group_id, digest = os.urandom(20), result_digest(result)
    listed = [k.peer_id for k in group]
    signed = {
        i: sign_attestation(
            k, group_id, mine["step"], mine["state_hash"], key.peer_id, weight, digest, listed
        )
        for i, k in enumerate(group[:signers])
    }
    return certificate(group_id, listed, weight, digest, signed)


def handoff(inputs, *, weight=64.0, keys=None, certs=None, declared=None, signers=None, included=None,
            forged=None, signed_mine=MINE, age_s=0.0):  # fmt: skip
    """A second-tier hand-off as a representative sends it: member ``i`` signs its entry at ``signed_mine``
    with weight ``declared[i]`` (default ``weight``) and ``certs[i]`` as its group certificate (default: a
    valid one; None: none); each part's chunks are signed by ``signers[part]`` (default: its own reducer)
    over the inputs of ``included`` (default: all), as their mean or ``forged``, dated ``age_s`` ago."""
    n = len(inputs)
    keys = keys or [SigningKey.generate() for _ in range(n)]
    names = [k.peer_id for k in keys]
    certs, declared = certs or {}, declared or {}
    cert = {i: certs.get(i, certified(keys[i], weight, inputs[i], mine=signed_mine)) for i in range(n)}
    bodies = [
        GroupEntryBody(schema_hash=SCHEMA, weight=declared.get(i, weight), commit=os.urandom(32),
                       extra={**signed_mine, **({"group": cert[i]} if cert[i] is not None else {})})
        for i in range(n)
    ]  # fmt: skip
    entries = [make_entry(k, PREFIX, b) for k, b in zip(keys, bodies, strict=True)]
    group_id, mask = os.urandom(20), reducer_mask([True] * n)
    digest = round_digest(PREFIX, group_id, names, [b.commit for b in bodies], mask)
    bounds, values = split_bounds(NUMEL, n, mask), layout_chunk_values(n, CODEC.bytes_per_value)
    signers = list(range(n)) if signers is None else signers
    listed = sorted(range(n) if included is None else included)
    mean = torch.stack([inputs[i] for i in listed]).mean(0) if forged is None else forged
    chunks = []
    for part in range(n):
        cuts = chunk_bounds(bounds[part + 1] - bounds[part], values)
        for chunk in range(len(cuts) - 1):
            lo, hi = bounds[part] + cuts[chunk], bounds[part] + cuts[chunk + 1]
            taken = input_entries([(i, weight, CODEC.encode_contribution(inputs[i][lo:hi])) for i in listed])
            data, at_ms = CODEC.encode(mean[lo:hi]), int((time.time() - age_s) * 1000)
            signature = keys[signers[part]].sign(
                aggregate_message(digest, part, chunk, names[signers[part]], taken, data, at_ms)
            )
            chunks.append(apb.PartChunk(part_index=part, chunk_index=chunk, data=data, signature=signature,
                                        included=taken, signed_at_ms=at_ms))  # fmt: skip
    header = apb.TierAnswer(tier_group_id=group_id, entries=entries, representative=0, signers=signers)
    return header, chunks, keys


def check_all(header, chunks, keys, contribution, *, weight=64.0, max_age_s=60.0, refusal=None):
    """What a member runs on its representative's hand-off (as ``SecondTier._follow`` does)."""
    check = TierCheck(
        header, prefix=PREFIX, schema_hash=SCHEMA, numel=NUMEL, mine=MINE,
        representative=keys[header.representative].peer_id, contribution=contribution, weight=weight,
        max_age_s=max_age_s, certify=None, refusal=refusal,
    )  # fmt: skip
    for (part, chunk), message in zip(check.expected(), chunks, strict=True):
        check.take(part, chunk, message)
    return check.output


# --- stand-ins for the network around SecondTier -------------------------------------------------------


def first_tier(n: int, weight: float = 16.0):
    """A complete first-tier round of ``n`` members (keys, group, the index of its representative)."""
    keys = [SigningKey.generate() for _ in range(n)]
    members = [k.peer_id for k in keys]
    commitments = [os.urandom(32) for _ in range(n)]
    group = GroupRound(os.urandom(20), members, [weight] * n, [MINE] * n, [None] * n, commitments=commitments,
                       reducers=[True] * n)  # fmt: skip
    return keys, group, representative(commitments, members, group.reducers)


def make_tier(keys, group, rep: int, vector, average) -> SecondTier:
    """A real ``SecondTier`` for ``keys[rep]``, whose averager is a stand-in calling ``average``; its board
    takes every other member's valid attestation as soon as the group opens."""
    weight, digest = math.fsum(group.weights), result_digest(vector)
    facts = (MINE["step"], MINE["state_hash"], keys[rep].peer_id, weight, digest)

    class Attested(TierBoard):
        def open(self, group_id, members, holds):
            super().open(group_id, members, holds)
            for key in keys:
                self.attest(group_id, key.peer_id, sign_attestation(key, group_id, *facts, members))

    tier = SecondTier.__new__(SecondTier)
    tier.numel, tier.signing_key, tier.board, tier._searches = NUMEL, keys[rep], Attested(), FailedSearches()
    tier.absent = MissedRounds()
    tier.min_group_size = 2
    tier.first = SimpleNamespace(sender_timeout_s=0.2, averaging_timeout_s=0.2)
    tier.averager = SimpleNamespace(
        prefix=PREFIX, schema_hash=SCHEMA, entry_max_age_s=600.0, sender_timeout_s=0.2,
        averaging_timeout_s=0.2, led_last_group=False,
        traffic=Traffic(), p2p=None, peer_id=keys[rep].peer_id, average=average,
        matchmaking_window_s=lambda failed_tries: 0.01,
        policy=SimpleNamespace(listed_refusal=lambda peer: None, certificate_refusal=lambda peer, cert: None),
    )  # fmt: skip
    return tier


async def posted(tier: SecondTier, group: GroupRound, asker: str):
    """What the representative's board hands ``asker``, a member of ``group``."""
    return await tier.board.wait(group.group_id, asker, b"", open_s=0.1, timeout_s=0.5)


# --- findings -------------------------------------------------------------------------------------------


def test_1_a_representative_naming_itself_every_parts_substitute_is_refused():
    """Attack (finding 1, succeeded before): the representative names itself the signer of every part
    and signs a made-up result; members applied it. Now a substitute signer is refused outright, a
    chunk it signs in its reducer's name does not verify, and a representative whose own tier-2 round
    was repaired by a substitute hands over nothing."""
    r_g = torch.randn(NUMEL)
    poison = torch.full((NUMEL,), 1000.0)
    header, chunks, keys = handoff([r_g, torch.randn(NUMEL)], signers=[0, 0], forged=poison)
    with pytest.raises(ProtocolError, match="other than a part's own reducer"):
        check_all(header, chunks, keys, r_g)
    header.signers[:] = [0, 1]  # claims the reducer signed; the rep's signature is on part 1's chunks
    with pytest.raises(ProtocolError, match=r"part 1 chunk 0"):
        check_all(header, chunks, keys, r_g)

    async def scenario():
        keys, group, rep = first_tier(4)
        vector = torch.randn(NUMEL)

        async def substituted(vector, weight, extra, **kwargs):
            tier_group = SimpleNamespace(group_id=os.urandom(20), peer_ids=[keys[rep].peer_id, "other"],
                                         weights=[64.0, 64.0], signed_entries=[b"", b""], extras=[])  # fmt: skip
            return tier_group, RoundResult(poison, True, signed=SignedOutput([0, 0], [[], []]))

        tier = make_tier(keys, group, rep, vector, substituted)
        applied = await tier.combine(group, RoundResult(vector, True), me=keys[rep].peer_id, extra=MINE,
                                     fits=None, peers_at_step=8, run_peers=8)  # fmt: skip
        return applied, await posted(tier, group, keys[(rep + 1) % 4].peer_id)

    assert asyncio.run(scenario()) == (None, None), "neither the representative nor its members apply it"


def test_2_sybil_identities_cannot_join_the_second_tier_as_groups():
    """Attack (finding 2, succeeded before): three Sybil identities declare under the tier-2 prefix next
    to two honest representatives and take over CenteredClip's result. Now an entry needs a certificate
    signed by a strict majority of a group's admitted members at the group's weight: without one, with
    only its own signature, with unadmitted co-signers, with an honest group's certificate copied, or at
    an inflated weight, it is refused by every member's check and by tier-2 members before the round."""
    honest = [torch.randn(NUMEL) * 0.1, torch.randn(NUMEL) * 0.1]
    target = torch.full((NUMEL,), 3.0)
    inputs = [*honest, target, target, target]
    keys = [SigningKey.generate() for _ in inputs]
    sybils = [SigningKey.generate() for _ in range(2)]
    unadmitted = {k.peer_id for k in sybils}
    refusal = lambda peer: "not admitted" if peer in unadmitted else None  # noqa: E731
    honest_cert = certified(keys[0], 64.0, honest[0])
    attempts = [
        ({2: None, 3: None, 4: None}, "carries no group certificate"),
        ({i: certified(keys[i], 64.0, target, signers=1) for i in (2, 3, 4)}, "not a majority"),
        (
            {i: certified(keys[i], 64.0, target, cosigners=sybils, signers=3) for i in (2, 3, 4)},
            "not a majority",
        ),
        ({2: honest_cert}, "not in"),
    ]
    for certs, reason in attempts:
        header, chunks, _ = handoff(inputs, keys=keys, certs=certs)
        with pytest.raises(ProtocolError, match=reason):
            check_all(header, chunks, keys, honest[0], refusal=refusal)
    header, chunks, _ = handoff(inputs, keys=keys, declared={2: 640.0})
    with pytest.raises(ProtocolError, match="another weight than its group signed"):
        check_all(header, chunks, keys, honest[0])

    # A tier-2 member refuses such an entry before the round (the matchmaking entry check).
    tier = make_tier(*first_tier(3)[:2], 0, torch.zeros(NUMEL), None)
    facts = SimpleNamespace(step=MINE["step"], state_hash=MINE["state_hash"])
    fits = tier._tier_fits(None, facts)
    sybil = keys[2].peer_id
    for extra, reason in [
        (dict(MINE), "no group certificate"),
        ({**MINE, "group": certified(keys[2], 64.0, target, signers=1)}, "not a majority"),
        ({**MINE, "group": honest_cert}, "not in"),
    ]:
        misfit = fits(
            GroupEntryBody(schema_hash=SCHEMA, weight=64.0, commit=os.urandom(32), extra=extra), sybil
        )
        assert misfit is not None and reason in misfit.reason
    good = {**MINE, "group": certified(keys[2], 64.0, target)}
    inflated = GroupEntryBody(schema_hash=SCHEMA, weight=640.0, commit=os.urandom(32), extra=good)
    assert "another weight" in fits(inflated, sybil).reason
    assert (
        fits(GroupEntryBody(schema_hash=SCHEMA, weight=64.0, commit=os.urandom(32), extra=good), sybil)
        is None
    )


def test_4_choosing_the_group_id_no_longer_steers_the_representative():
    """Attack (finding 4, succeeded before): the matchmaking leader, which picks the group ID after seeing
    every member, ground IDs until it was the representative (a few dozen hashes). Now the draw takes no
    group ID: it follows from the members' nonce commitments fixed in their signed entries."""
    assert list(inspect.signature(representative).parameters) == ["commitments", "members", "reducers"]
    keys, group, chosen = first_tier(16)
    attacker = (chosen + 1) % 16
    for _ in range(2000):  # the old attack: try group IDs until the attacker is drawn
        group.group_id = os.urandom(20)
        assert representative(group.commitments, group.peer_ids, group.reducers) == chosen != attacker
    # Nor does the order the leader lists members in (it could pick its own draw among n! orders before).
    names = [str(p) for p in group.peer_ids]
    for shift in range(1, 16):
        order = [(i + shift) % 16 for i in range(16)]
        listed = [names[i] for i in order]
        picked = representative(
            [group.commitments[i] for i in order], listed, [group.reducers[i] for i in order]
        )
        assert listed[picked] == names[chosen]
    drawn = set()
    for _ in range(64):  # what does move it: another commitment (fixed before the group forms)
        group.commitments[attacker] = os.urandom(32)
        drawn.add(representative(group.commitments, group.peer_ids, group.reducers))
    assert len(drawn) > 1


def test_5_a_hand_off_that_leaves_the_groups_input_out_is_refused():
    """Attack (finding 5, succeeded before): the representative withholds its input from the tier-2
    reducers, so its members applied a combination without their own group. Now refused."""
    r_g = torch.randn(NUMEL)
    header, chunks, keys = handoff([r_g, torch.randn(NUMEL) + 5.0, torch.randn(NUMEL) + 5.0], included={1, 2})
    with pytest.raises(ProtocolError, match="leaves out the input of this peer's group"):
        check_all(header, chunks, keys, r_g)


def test_6_an_earlier_steps_or_another_states_round_is_refused():
    """Attack (finding 6, succeeded before): a representative replays step 3's honestly signed tier-2 round
    to its group at step 7, so an old update was applied twice. Now every entry must have been signed at
    the member's own step and state."""
    r_g = torch.randn(NUMEL)
    for mine in ({**MINE, "step": 3}, {**MINE, "state_hash": "cd" * 32}):
        header, chunks, keys = handoff([r_g, torch.randn(NUMEL), torch.randn(NUMEL)], included={0, 1, 2},
                                       signed_mine=mine, age_s=60.0)  # fmt: skip
        with pytest.raises(ProtocolError, match="another step or state"):
            check_all(header, chunks, keys, r_g)


def test_7a_progress_records_far_behind_the_step_or_of_suspects_are_not_counted():
    """Attack (finding 7, succeeded before): Sybils publishing progress at step 0 (or suspects) counted as
    peers "at this step", so an honest group that held every real peer looked for a second tier. Now only
    records at this step or one behind, of peers not refused, count."""
    others = [SimpleNamespace(peer_id=f"h{i}", step=7) for i in range(3)]
    others += [SimpleNamespace(peer_id="behind", step=6), SimpleNamespace(peer_id="suspect", step=7)]
    others += [SimpleNamespace(peer_id=f"sybil{i}", step=0) for i in range(4)]
    seen = {}

    async def average(vector, weight, extra, **kwargs):
        group = SimpleNamespace(peer_ids=["me", "h0", "h1", "h2"], extras=[extra] * 4, excluded=[])
        return group, RoundResult(vector, True)

    async def combine(group, result, *, peers_at_step, **kwargs):
        seen["peers_at_step"] = peers_at_step

    peer = SimpleNamespace(
        view={p.peer_id: p for p in others}, peer_id="me", step=7, samples=32,
        config=SimpleNamespace(training=SimpleNamespace(min_group_size=2)),
        hooks=SimpleNamespace(contribute=lambda peer, v: v, weight=lambda w: w, entry=lambda e: e),
        strategy=SimpleNamespace(contribution=lambda s: torch.zeros(4), weight=lambda s: float(s)),
        _own_contribution=lambda: torch.zeros(4),  # TrainingPeer._own_contribution, finite
        _round_extra=lambda: dict(MINE), averager=SimpleNamespace(average=average), _averaged=None,
        policy=SimpleNamespace(
            refusal=lambda p: "suspected" if p == "suspect" else None, member_count=lambda: 0,
            refresh_members=lambda: asyncio.sleep(0),
        ),
        _searches=FailedSearches(), _stats={"last_round_s": 0.0, "averaging_s": 0.0, "rounds_failed": 0},
        _journal=lambda *a, **k: None,
        _adopt=lambda extra: asyncio.sleep(0, False),  # nobody a step ahead to adopt from
        _group_usable=lambda group: True, tiers=SimpleNamespace(combine=combine), _ahead=lambda: [], _showing=set,
        sender_checks=SimpleNamespace(enabled=False), groupmates=Groupmates(),
    )  # fmt: skip
    asyncio.run(TrainingPeer._round(peer))
    assert seen == {"peers_at_step": 5}, "itself, three at step 7 and one at step 6; not 10"


def test_7b_a_group_whose_second_tier_never_forms_applies_its_own_result_after_a_few_tries():
    """Attack (finding 7, succeeded before): with Sybil records claiming peers at the step, the honest
    group's representative searched for a second tier nobody joined and its group applied nothing, every
    step, forever. Now after ``ALONE_AFTER_TRIES`` failed searches at a step it applies its own result,
    and tells its members so; each search widens its window. A failed search is tried again at once with
    the group's one first-tier result while the members' wait leaves room for a search and a round, but
    never up to the last try: that one comes with the next round, after the peer looked for peers ahead to
    adopt the step's combined result from (``tests/test_tier_retry_redteam.py``)."""
    tries = []
    pause = {"s": 0.0}

    async def nobody(vector, weight, extra, *, failed_tries, **kwargs):
        tries.append(failed_tries)
        await asyncio.sleep(pause["s"])
        return None

    async def scenario():
        keys, group, rep = first_tier(4)
        vector = torch.randn(NUMEL)
        tier = make_tier(keys, group, rep, vector, nobody)
        me, asker = keys[rep].peer_id, keys[(rep + 1) % 4].peer_id

        async def combine():
            group.group_id = os.urandom(20)  # each call is a new first-tier round at the same step
            applied = await tier.combine(
                group, RoundResult(vector, True), me=me, extra=MINE, fits=None, peers_at_step=12, run_peers=12
            )
            return applied, await posted(tier, group, asker)

        first, first_told = await combine()
        assert (first, first_told) == (None, None) and tries == [1, 2], "two searches, then nothing yet"
        last, last_told = await combine()
        assert tries == [1, 2, 3], "each search wider"
        # Searches that take longer: the members' wait (4T = 0.8 s) leaves no room for another search and
        # round (0.4 s) after one of 0.45 s.
        pause["s"], tries[:] = 0.45, []
        tier._searches = FailedSearches()
        late, late_told = await combine()
        assert (late, late_told) == (None, None) and tries == [1], "no search the members cannot wait for"
        return last, last_told, vector

    last, told, vector = asyncio.run(scenario())
    assert last is not None and torch.equal(last.vector, vector), "not stalled forever"
    assert told.alone, "its members apply their own result too"


def test_8_an_honest_hand_off_older_than_the_clock_bound_is_accepted():
    """Attack (finding 8, succeeded before): a tier-2 round plus the hand-off taking over 120 s made every
    member refuse its honest representative's result and suspect it. Now aggregates may be as old as an
    entry (the clock bound plus ``max_age_s``); beyond that they are still refused."""
    r_g = torch.randn(NUMEL)
    header, chunks, keys = handoff([r_g, torch.randn(NUMEL)], age_s=125.0)
    output = check_all(header, chunks, keys, r_g, max_age_s=60.0)
    decoded = torch.cat([CODEC.decode(c.data, len(c.data) // 2, sender="reducer") for c in chunks])
    assert torch.equal(output, decoded)
    header, chunks, keys = handoff([r_g, torch.randn(NUMEL)], age_s=200.0)
    with pytest.raises(ProtocolError, match="dated"):
        check_all(header, chunks, keys, r_g, max_age_s=60.0)


def test_10_a_majority_group_no_longer_applies_its_own_result_when_its_search_fails():
    """Attack (finding 10, succeeded before): a group holding a strict majority of the step applied its own
    result as soon as its tier-2 search failed, while the smaller groups' representatives may have formed
    a tier-2 round among themselves: two updates at one step. Now the fallback is gone: a failed search
    applies nothing, for the representative and its members alike (it searches again while its members'
    wait allows, and applies its own result only after ``ALONE_AFTER_TRIES`` searches at the step, the last
    in a later round)."""

    async def nobody(*args, **kwargs):
        return None

    async def scenario():
        keys, group, rep = first_tier(5)
        vector = torch.randn(NUMEL)
        tier = make_tier(keys, group, rep, vector, nobody)
        applied = await tier.combine(group, RoundResult(vector, True), me=keys[rep].peer_id, extra=MINE,
                                     fits=None, peers_at_step=9, run_peers=9)  # fmt: skip
        return applied, await posted(tier, group, keys[(rep + 1) % 5].peer_id)

    assert asyncio.run(scenario()) == (None, None)


def test_11_a_stranger_is_refused_at_once_instead_of_holding_a_stream():
    """Attack (finding 11, succeeded before): a stranger asking a representative for a made-up group ID
    held one of its ``rpc_tier_result`` streams for the whole wait (3x the averaging timeout), so 128 Sybils
    kept every slot busy. Now a caller that is no member of a recent first-tier round with that ID gets
    NOT_IN_GROUP at once, and the board gives up on a group it does not hold after ``open_s``."""
    keys, group, _ = first_tier(3)
    rounds = {group.group_id: SimpleNamespace(members=list(group.peer_ids))}
    tier = SecondTier.__new__(SecondTier)
    tier.first = SimpleNamespace(rounds=SimpleNamespace(lookup=rounds.get))
    assert tier._known(group.group_id, keys[1].peer_id)
    assert not tier._known(group.group_id, "stranger") and not tier._known(os.urandom(20), keys[1].peer_id)

    async def scenario():
        board = TierBoard()
        servicer = TierServicer(
            board, known=tier._known, wait_s=lambda: 30.0, admission=None, traffic=Traffic()
        )
        answers = []
        for asker, group_id in [("stranger", os.urandom(20)), ("stranger", group.group_id),
                                (keys[1].peer_id, os.urandom(20))]:  # fmt: skip
            context = SimpleNamespace(remote_id=SimpleNamespace(to_base58=lambda asker=asker: asker))
            request = apb.TierRequest(group_id=group_id, attestation=b"")
            started = time.monotonic()
            async for answer in servicer.rpc_tier_result(request, context):
                answers.append((answer.code, time.monotonic() - started))
        started = time.monotonic()
        with pytest.raises(ProtocolError, match="represents no such group"):
            await board.wait(os.urandom(20), keys[1].peer_id, b"", open_s=0.2, timeout_s=30.0)
        return answers, time.monotonic() - started

    answers, waited = asyncio.run(scenario())
    assert [code for code, _ in answers] == [apb.NOT_IN_GROUP] * 3
    assert all(took < 1.0 for _, took in answers), "refused at once, not after the 30 s wait"
    assert waited < 1.0


def test_a_representative_keeps_the_combined_result_it_applied_for_peers_that_fell_behind():
    """Adoption asks peers a step ahead for the step's combined result; a representative is one of them as
    often as any member, so it must keep what its second tier gave (a scale simulation found it did not)."""

    async def scenario():
        keys, group, rep = first_tier(4)
        vector, combined = torch.randn(NUMEL), torch.randn(NUMEL)

        async def complete(vector, weight, extra, **kwargs):
            tier_group = SimpleNamespace(group_id=os.urandom(20), peer_ids=[keys[rep].peer_id, "other"],
                                         weights=[64.0, 64.0], signed_entries=[b"e0", b"e1"], extras=[])  # fmt: skip
            return tier_group, RoundResult(combined, True, signed=SignedOutput([0, 1], [[], []]))

        tier = make_tier(keys, group, rep, vector, complete)
        applied = await tier.combine(group, RoundResult(vector, True), me=keys[rep].peer_id, extra=MINE,
                                     fits=None, peers_at_step=8, run_peers=8)  # fmt: skip
        return applied, combined, tier.board.applied(MINE["step"])

    applied, combined, kept = asyncio.run(scenario())
    assert applied is not None and torch.equal(applied.vector, combined), "the representative applies it"
    assert kept is not None and kept.entries == [b"e0", b"e1"], "kept for a peer that fell behind"
