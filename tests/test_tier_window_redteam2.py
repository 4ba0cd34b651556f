"""What a second attacker's read of the second tier's early close found after bd99ac5, each now a regression
test that failed on it. In-process, with the real classes (real hivemind averagers over loopback DHTs in
the one test where matchmaking timing matters).

n1 (medium): an attestation did not sign the group's member list, so a malicious representative of an
honest group listed honest peers of other groups under its members' real signatures; now members sign
their group's member list (``tiercert.attestation_message``). n2 (medium): the absence book believed
whichever round a peer was in (a liar's hand-off, a Sybil-led round), so one step's liar could make an
honest peer's next search close without the other honest groups; now only a leader that waited its window
out writes its book, and a book that would leave out more than ``MAX_ABSENT_SHARE`` of the peers is not
read (nor written). n3 (medium): a malformed claim raised in the closing rule at every later join, so one
identity held every search it joined for the whole window; now claims are shape-checked first
(``tiercert.certificate_shape_misfit``) and a malformed one counts for nothing. n4 (low): a claim naming
admitted signers with garbage signatures forced the whole certificate check; now the counted signers are
verified first, up to the first that fails. n5 (low): the signer dedup ran on unchecked claims, so a claim
naming an honest group's signers kept that group from counting; now claims are counted without it, and
only checked certificates are deduplicated (``tiers.EarlyClose``).
"""

from __future__ import annotations

import asyncio
import os
import time
from types import SimpleNamespace

import pytest
import torch
from hivemind.p2p import PeerID
from test_tier_window_redteam import (
    MINE,
    PREFIX,
    SCHEMA,
    first_tier_of,
    honest_cert,
    prefix,  # noqa: F401, F811  (the fixture)
    represent,
    tier_averager,
    tier_for,
)

from protocols.keys import SigningKey
from swarm.averaging import tiercert
from swarm.averaging.groups import GroupEntryBody, make_entry
from swarm.averaging.matchmaking import RunMatchmaking, closing_rule
from swarm.averaging.missed import MissedRounds
from swarm.averaging.policy import PeerPolicy
from swarm.averaging.tiercert import certificate, certificate_misfit, result_digest, sign_attestation
from swarm.averaging.tiers import EarlyClose
from swarm.training.tiered import SecondTier, _Facts

pytestmark = pytest.mark.timeout(30)


# --- helpers -------------------------------------------------------------------------------------------------


def ids(keys):
    return [k.peer_id for k in keys]


def keys_of(n: int) -> list[SigningKey]:
    return [SigningKey.generate() for _ in range(n)]


def stub_tier(policy: PeerPolicy) -> SecondTier:
    """A ``SecondTier`` with only what ``_counts``, ``_waited_for``, ``_observe`` and ``_tier_fits`` read."""
    tier = SecondTier.__new__(SecondTier)
    tier.averager, tier.absent, tier.min_group_size = SimpleNamespace(policy=policy), MissedRounds(), 2
    return tier


def leader_rule(tier: SecondTier, own: list[str], here: set[str], rep: str):
    """The closing rule a representative's search runs, built exactly as ``SecondTier._represent`` builds it
    (``EarlyClose``) and as ``Averager.find_group`` wraps it (``closing_rule``, the tier's real ``fits``)."""
    facts = _Facts(os.urandom(20), MINE["step"], MINE["state_hash"], rep, 32.0, bytes(32), tuple(own))
    closing = EarlyClose(
        waiting=lambda: tier._waited_for(lambda: here) - set(own), fits=tier._tier_fits(None, facts),
        counts=tier._counts, step=MINE["step"], state_hash=MINE["state_hash"], min_members=2,
    )  # fmt: skip
    return closing_rule(closing, prefix=PREFIX, schema_hash=SCHEMA, signed=True, max_age_s=60.0, limit=64)


def follower(key: SigningKey, extra: dict, weight: float = 48.0):
    """A join request as hivemind keeps it in ``current_followers``: the follower's signed entry."""
    body = GroupEntryBody(schema_hash=SCHEMA, weight=weight, commit=bytes(32), extra=extra)
    return PeerID.from_base58(key.peer_id), SimpleNamespace(gather=make_entry(key, PREFIX, body))


def entry_of(key: SigningKey, cert: dict):
    return follower(key, {**MINE, "group": cert}, weight=cert["weight"])


def partial_cert(keys: list[SigningKey], rep: int, signers: list[int], weight: float = 48.0) -> dict:
    """An honest group's certificate as ``TierBoard.majority`` hands it over: the first strict majority of its
    members that attested, the rest listed and unsigned."""
    group_id = os.urandom(20)
    digest = result_digest(torch.randn(8))
    facts = (group_id, MINE["step"], MINE["state_hash"], keys[rep].peer_id, weight, digest, ids(keys))
    signed = {i: sign_attestation(keys[i], *facts) for i in signers}
    return certificate(group_id, ids(keys), weight, digest, signed)


# --- n1: a member list nobody signed ---------------------------------------------------------------------------


def test_n1_a_representative_cannot_list_peers_its_members_did_not_sign_for():
    """Medium on bd99ac5: ``attestation_message`` signed (group ID, step, state, representative, weight,
    digest), not the member list. M, the representative of an honest group G (M + 4 honest members, who all
    attest as they must), listed G and the 4 members of another honest group H under G's 5 real signatures:
    5 of 9 is a strict majority, so it held and counted, and the honest leader L closed its window the
    moment M joined, leaving H out. Now members sign their group's member list: the inflated certificate
    does not hold, and counts for nothing."""
    l_keys, g_keys, h_keys = keys_of(3), keys_of(5), keys_of(4)
    m = g_keys[0]
    policy = PeerPolicy(None, "run", allowed=ids(l_keys) + ids(g_keys) + ids(h_keys))
    group_id, weight, digest = os.urandom(20), 80.0, result_digest(torch.randn(8))
    facts = (group_id, MINE["step"], MINE["state_hash"], m.peer_id, weight, digest, ids(g_keys))
    signed = {i: sign_attestation(k, *facts) for i, k in enumerate(g_keys)}  # G's honest attestations to M
    inflated = certificate(group_id, ids(g_keys) + ids(h_keys), weight, digest, signed)
    assert certificate_misfit({**MINE, "group": inflated}, signer=m.peer_id, step=MINE["step"],
                              state_hash=MINE["state_hash"], refusal=policy.listed_refusal) is not None  # fmt: skip
    here = set(ids(l_keys) + ids(g_keys) + ids(h_keys))
    full = leader_rule(stub_tier(policy), ids(l_keys), here, l_keys[0].peer_id)
    assert not full(dict([entry_of(m, inflated)])), "M's join does not close L's window"
    true = certificate(group_id, ids(g_keys), weight, digest, signed)
    assert not full(dict([entry_of(m, inflated), entry_of(h_keys[0], honest_cert(h_keys, 0, 48.0, digest))]))
    assert leader_rule(stub_tier(policy), ids(l_keys), here, l_keys[0].peer_id)(
        dict([entry_of(m, true), entry_of(h_keys[0], honest_cert(h_keys, 0, 48.0, digest))])
    ), "G's true certificate and H's close it"


# --- n2: the absence book believes whichever round this peer was in --------------------------------------------


def test_n2_a_book_that_would_leave_out_most_of_the_step_is_neither_written_nor_read():
    """Medium on bd99ac5: ``_observe`` took "not in the round this peer was in" for "missed the step", and ran
    on hand-offs and on rounds others led: a malicious representative's round of its group and a made-up
    Sybil group marked every other honest peer at the step absent in its honest members' books, and at the
    next step such a member, as representative, closed its window at the first honest group's join. Now only
    a leader that waited its window out writes its book (``SecondTier._represent``: ``led_last_group`` and
    not ``EarlyClose.closed``; ``_follow`` writes nothing), a round that leaves out more than
    ``MAX_ABSENT_SHARE`` of the peers showing the step writes nothing, and a book that would leave out more
    than that is not read."""
    a_keys, sybils = keys_of(4), keys_of(2)
    b_keys, c_keys, d_keys = keys_of(4), keys_of(4), keys_of(4)
    honest = ids(a_keys) + ids(b_keys) + ids(c_keys) + ids(d_keys)
    policy = PeerPolicy(None, "run", allowed=honest + ids(sybils))
    a_cert = honest_cert(a_keys, 0, 64.0, result_digest(torch.randn(8)))
    s_cert = honest_cert(sybils, 0, 1.0, result_digest(torch.randn(8)))
    tier = stub_tier(policy)
    here = set(honest)
    tier._observe(lambda: here, [a_cert, s_cert], set(ids(a_keys)))
    others = ids(b_keys) + ids(c_keys) + ids(d_keys)
    assert all(tier.absent.refusal(p) is None for p in others), "12 of 16 left out: nothing written"
    # A book poisoned some other way is not read when it would leave out most of the step.
    tier.absent.round(delivered=[], missed=dict.fromkeys(others, "poisoned"), denied={})
    tier.absent.search()
    assert tier._waited_for(lambda: here) == here
    b_join = dict([entry_of(b_keys[0], honest_cert(b_keys, 0, 64.0, result_digest(torch.randn(8))))])
    assert not leader_rule(tier, ids(a_keys), here, a_keys[1].peer_id)(b_join), "waits for C and D"


# --- n3: an exception in phase one disables the early close for the whole search -------------------------------


@pytest.mark.parametrize(
    "bad",
    [
        {**MINE},  # no "group" at all: KeyError in complete_step
        {**MINE, "group": {"members": ["x", "y"], "signed": [[0]]}},  # ValueError unpacking
        {**MINE, "group": {"members": [["x"]], "signed": [[0, b""]]}},  # unhashable member: TypeError
        {**MINE, "group": {"members": 7, "signed": []}},  # TypeError on len()
    ],
    ids=["no-group", "short-signed", "unhashable-member", "members-not-a-list"],
)
def test_n3_a_malformed_claim_counts_for_nothing_and_the_next_join_still_closes_the_window(bad):
    """Medium on bd99ac5: the closing rule indexed the unchecked ``extra["group"]`` of each claim; a follower
    whose signed entry carried a malformed one raised at its own join and every later one, and
    ``_assemble_if_full`` never assembled: one identity held every search it joined for the whole window.
    Now claims are shape-checked first (``tiercert.certificate_shape_misfit``) and a malformed one counts for
    nothing."""
    l_keys, h_keys, s = keys_of(2), keys_of(3), SigningKey.generate()
    policy = PeerPolicy(None, "run", allowed=ids(l_keys) + ids(h_keys) + [s.peer_id])
    here = set(ids(l_keys) + ids(h_keys))
    h_entry = entry_of(h_keys[0], honest_cert(h_keys, 0, 48.0, result_digest(torch.randn(8))))
    clean = leader_rule(stub_tier(policy), ids(l_keys), here, l_keys[0].peer_id)
    assert clean(dict([h_entry])), "control: H's join completes the step"

    full = leader_rule(stub_tier(policy), ids(l_keys), here, l_keys[0].peer_id)
    followers = dict([follower(s, bad)])
    assert not full(followers)
    followers.update([h_entry])
    assert full(followers), "the malformed claim counts for nothing; H's join completes the step"

    assembled = []

    async def assemble():
        assembled.append(1)

    mm = SimpleNamespace(full=full, assembled_group=SimpleNamespace(done=lambda: False),
                         is_looking_for_group=True, current_leader=None, current_followers=followers,
                         min_group_size=2, leader_assemble_group=assemble)  # fmt: skip
    asyncio.run(RunMatchmaking._assemble_if_full(mm))
    assert assembled == [1], "the leader assembles"


def test_n3_live_a_sybil_with_a_malformed_entry_does_not_hold_an_honest_leaders_window(
    keyed_dhts,
    prefix,  # noqa: F811
):
    """The same with real averagers: L leads a search whose window is about 6 s; S, an admitted identity, joins
    at 1 s with an entry whose ``extra`` has no ``group``; H, whose group is all L waits for, joins at 2 s,
    and L closes then (it waited out the whole window on bd99ac5)."""
    (d_l, k_l), (d_s, k_s), (d_h, k_h) = keyed_dhts
    T = 3.0  # window: about 2T
    keys, members, group, vector, facts = first_tier_of(k_l)
    h_keys = [k_h, SigningKey.generate(), SigningKey.generate()]
    leader, sybil, other = (tier_averager(d, k, prefix, T) for d, k in ((d_l, k_l), (d_s, k_s), (d_h, k_h)))
    tier = tier_for(leader, k_l)
    here = {*members, *ids(h_keys)}
    h_vector = torch.randn(8 * 125)
    h_cert = honest_cert(h_keys, 0, 48.0, result_digest(h_vector))
    # H checks the second tier's entries as every representative does (``SecondTier._tier_fits``).
    h_facts = _Facts(
        os.urandom(20), MINE["step"], MINE["state_hash"], k_h.peer_id, 48.0, bytes(32), tuple(ids(h_keys))
    )
    h_fits = SecondTier._tier_fits(SimpleNamespace(averager=other, min_group_size=2), None, h_facts)

    async def scenario():
        for a in (leader, sybil, other):
            await a.start()
        sybil.longest_search_s = other.longest_search_s = 4 * T
        started = time.monotonic()

        async def sybil_joins():
            await asyncio.sleep(1.0)
            return await sybil.average(torch.zeros(1000), 48.0, dict(MINE), window_s=2 * T)

        async def h_joins():
            await asyncio.sleep(2.0)
            return await other.average(h_vector, 48.0, {**MINE, "group": h_cert}, window_s=2 * T, fits=h_fits)

        async def lead():
            out = await represent(tier, keys, members, group, vector, facts, here)
            return out, time.monotonic() - started

        return await asyncio.gather(lead(), sybil_joins(), h_joins(), return_exceptions=True)

    lead_out, _, _ = asyncio.run(scenario())
    (_, tier_group), took_s = lead_out
    assert tier_group is not None and k_h.peer_id in tier_group, tier_group
    assert took_s < 2 * T - 1.0, f"L waited {took_s:.1f}s of its {2 * T:.0f}s window though H joined at 2 s"


# --- n4: a claim that "would close" is free to make ------------------------------------------------------------


def test_n4_a_claim_naming_admitted_signers_with_garbage_signatures_costs_one_check(monkeypatch):
    """Low on bd99ac5: the first phase counted a claim's listed signers unverified, so a claim naming 300
    admitted honest peers as signers with garbage signatures, beside 298 throwaway keys with valid ones,
    would always close the window, and every leader it joined verified the 299 valid signatures before the
    first garbage one failed. Now a claim's counted signers (admitted) are verified first, up to the first
    that fails, and only a certificate whose counted signers are a majority gets the full check."""
    coordinator = SigningKey.generate()
    honest = [SigningKey.generate().peer_id for _ in range(300)]
    s = SigningKey.generate()
    own = [SigningKey.generate().peer_id for _ in range(2)]
    admitted = {s.peer_id, *honest, *own}
    policy = PeerPolicy(None, "run", coordinator_key=coordinator.public_key, also_certified=lambda: admitted)
    throwaway = keys_of(298)
    group_id, weight, digest = os.urandom(20), 16.0, bytes(32)
    members = [s.peer_id, *ids(throwaway), *honest]
    facts = (group_id, MINE["step"], MINE["state_hash"], s.peer_id, weight, digest, members)
    signed = {i: sign_attestation(k, *facts) for i, k in enumerate([s, *throwaway])}
    signed.update({1 + len(throwaway) + j: os.urandom(64) for j in range(len(honest))})
    cert = certificate(group_id, members, weight, digest, signed)
    calls = []
    real = tiercert.attestation_holds
    monkeypatch.setattr(tiercert, "attestation_holds", lambda *a: calls.append(1) or real(*a))
    full = leader_rule(stub_tier(policy), own, set(honest) | set(own), own[0])
    assert not full(dict([entry_of(s, cert)])), "it does not close (its certificate does not hold)"
    assert len(calls) <= 2, f"{len(calls)} signatures verified for a certificate that does not hold"


# --- n5: the signer dedup runs on unchecked claims ------------------------------------------------------------


def test_n5_a_claim_that_joins_first_naming_an_honest_groups_signers_does_not_keep_that_group_from_counting():
    """Low on bd99ac5: the signer dedup ran over unchecked claims in join order. S joined first with a claim
    naming B's three attesting members as its signers (garbage signatures); B's true certificate then
    counted for nothing, and the window ran its course. Now claims are counted without the dedup, and only
    checked certificates are deduplicated: S's claim fails its check, and B's join closes the window."""
    l_keys, b_keys, s = keys_of(2), keys_of(5), SigningKey.generate()
    policy = PeerPolicy(None, "run", allowed=ids(l_keys) + ids(b_keys) + [s.peer_id])
    here = set(ids(l_keys) + ids(b_keys))
    b_entry = entry_of(b_keys[0], partial_cert(b_keys, 0, [0, 1, 2]))
    assert leader_rule(stub_tier(policy), ids(l_keys), here, l_keys[0].peer_id)(dict([b_entry])), "control"

    claim = certificate(os.urandom(20), [*ids(b_keys[:3]), s.peer_id], 1.0, bytes(32),
                        {i: os.urandom(64) for i in range(4)})  # fmt: skip
    full = leader_rule(stub_tier(policy), ids(l_keys), here, l_keys[0].peer_id)
    followers = dict([entry_of(s, claim)])
    assert not full(followers)
    followers.update([b_entry])
    assert full(followers), "B's join completes the step"
