"""What an attacker's read of 95e6864 found in the second tier's long window and early close
(``tiers.second_window_s``, ``tiers.covers``, ``matchmaking.closing_rule``, ``RunMatchmaking._assemble_if_full``),
each now a regression test that failed on it.

All run in-process with the real classes (real hivemind averagers over loopback DHTs where matchmaking
matters); the only stand-ins are a representative's first-tier facts (its group's attestations are signed by
keys the test holds).

f1/f1b (high): a made-up certificate's member list (its majority from keys nobody admitted, in a coordinated
run) closed an honest leader's window at once and left later honest groups out; now a certificate's listed
members count only with a strict majority of admitted signers that signed no other counted certificate
(``tiers.covered_peers``). f2/f2b (medium): one record-only identity held every multi-group step for the
whole window; now a peer whose records showed a step combined without it is not waited for again for a
span of steps (``SecondTier.absent``). f3 (low): every join verified its certificate's signatures inside
hivemind's join lock; now only a claim that would close the window is checked. f4 (low): the peers to wait
for were one snapshot of the records; now they are read again at each join.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import time
from types import SimpleNamespace

import pytest
import torch
from hivemind.p2p import PeerID

from protocols.keys import SigningKey
from swarm.averaging import tiercert
from swarm.averaging.allreduce import RoundResult
from swarm.averaging.averager import Averager, GroupRound
from swarm.averaging.groups import GroupEntryBody, make_entry
from swarm.averaging.matchmaking import FailedSearches, closing_rule
from swarm.averaging.missed import MissedRounds
from swarm.averaging.policy import PeerPolicy
from swarm.averaging.tiercert import certificate, certificate_misfit, result_digest, sign_attestation
from swarm.averaging.tiers import EarlyClose
from swarm.averaging.tierserve import TierBoard
from swarm.training.tiered import SecondTier, _Facts

pytestmark = pytest.mark.timeout(60)

NUMEL = 1000
MINE = {"step": 7, "state_hash": "ab" * 32}
SCHEMA = hashlib.sha256(b"schema").digest()
PREFIX = "swarm-tier-redteam-unit"


# --- helpers -------------------------------------------------------------------------------------------------


def honest_cert(keys: list[SigningKey], rep: int, weight: float, digest: bytes, mine=MINE) -> dict:
    """The certificate a real first-tier group of ``keys`` hands its representative ``keys[rep]``: every member
    attests the same facts."""
    group_id, members = os.urandom(20), [k.peer_id for k in keys]
    facts = (group_id, mine["step"], mine["state_hash"], keys[rep].peer_id, weight, digest, members)
    signed = {i: sign_attestation(k, *facts) for i, k in enumerate(keys)}
    return certificate(group_id, members, weight, digest, signed)


def made_up_cert(signer: SigningKey, weight: float, digest: bytes, listed: list[str], *, throwaway: int | None = None,
                 cosigners: list[SigningKey] | None = None, mine=MINE) -> dict:  # fmt: skip
    """A certificate of a group that never ran: ``signer`` (the one admitted identity), ``throwaway`` fresh keys
    nobody admitted (default: as many as ``listed``, enough for a strict majority) or ``cosigners``, and the
    honest peers ``listed``, who signed nothing. Signed by everyone but the listed honest peers."""
    others = cosigners if cosigners is not None else [SigningKey.generate() for _ in range(
        len(listed) if throwaway is None else throwaway)]  # fmt: skip
    group_id = os.urandom(20)
    signing = [signer, *others]
    members = [k.peer_id for k in signing] + list(listed)
    facts = (group_id, mine["step"], mine["state_hash"], signer.peer_id, weight, digest, members)
    signed = {i: sign_attestation(k, *facts) for i, k in enumerate(signing)}
    return certificate(group_id, members, weight, digest, signed)


class AttestedBoard(TierBoard):
    """A representative's board whose group members (keys the test holds) attest as soon as it opens."""

    def __init__(self, keys: list[SigningKey], facts: _Facts):
        super().__init__()
        self.keys, self.facts = keys, facts

    def open(self, group_id, members, holds):
        super().open(group_id, members, holds)
        f = self.facts
        for key in self.keys:
            self.attest(group_id, key.peer_id, sign_attestation(key, group_id, f.step, f.state_hash,
                                                                f.representative, f.weight, f.digest, f.members))  # fmt: skip


def tier_for(averager: Averager, key: SigningKey) -> SecondTier:
    """A real ``SecondTier`` around a real tier averager, set up as ``SecondTier.__init__`` does (its
    ``longest_search_s`` is the members' wait), without the servicer (nobody asks for the hand-off here)."""
    tier = SecondTier.__new__(SecondTier)
    tier.averager, tier.signing_key, tier.numel = averager, key, NUMEL
    tier.first = SimpleNamespace(averaging_timeout_s=1.0, sender_timeout_s=1.0)
    tier.min_group_size, tier.relay_fanout = 2, 2
    tier.board, tier._searches, tier.absent = TierBoard(), FailedSearches(), MissedRounds()
    averager.counts_searches = False
    averager.longest_search_s = tier.wait_s
    return tier


def first_tier_of(rep_key: SigningKey, size: int = 3, weight: float = 16.0):
    """A complete first-tier round of ``rep_key`` and ``size - 1`` fresh members, with its facts."""
    keys = [rep_key, *(SigningKey.generate() for _ in range(size - 1))]
    members = [k.peer_id for k in keys]
    vector = torch.randn(NUMEL)
    group = GroupRound(os.urandom(20), members, [weight] * size, [MINE] * size, [None] * size,
                       commitments=[os.urandom(32) for _ in keys], reducers=[True] * size)  # fmt: skip
    facts = _Facts(group.group_id, MINE["step"], MINE["state_hash"], rep_key.peer_id, weight * size,
                   result_digest(vector), tuple(members))  # fmt: skip
    return keys, members, group, vector, facts


async def represent(tier: SecondTier, keys, members, group, vector, facts, here, peers_at_step=30):
    """``SecondTier._represent`` as ``combine`` calls it for the representative (``here``: the records at the
    step); returns what it applies and the second-tier group it formed (None if none)."""
    tier.board = AttestedBoard(keys, facts)
    formed: dict = {}
    original = tier.averager.average

    async def spy(*args, **kwargs):
        formed["out"] = await original(*args, **kwargs)
        return formed["out"]

    tier.averager.average = spy
    try:
        applied = await tier._represent(group, RoundResult(vector, True), members, facts, dict(MINE), None,
                                        peers_at_step, peers_at_step, list, lambda: set(here),
                                        lambda: set(here))  # fmt: skip
    finally:
        del tier.averager.average
    out = formed.get("out")
    return applied, (None if out is None else [str(p) for p in out[0].peer_ids])


def tier_averager(dht, key: SigningKey, prefix: str, averaging_timeout_s: float, policy=None) -> Averager:
    return Averager(dht, numel=NUMEL, signing_key=key, prefix=prefix, matchmaking_time_s=1.0,
                    averaging_timeout_s=averaging_timeout_s, data_plane=False, policy=policy)  # fmt: skip


@pytest.fixture
def prefix(request) -> str:
    return "tierwin-" + "".join(c if c.isalnum() else "-" for c in request.node.name)[-50:]


# --- finding 1: a made-up member list closed an honest leader's window at once ---------------------------------


def test_f1_a_made_up_certificate_does_not_close_a_representatives_window_and_later_honest_groups_come_in(
    keyed_dhts, prefix
):
    """Attack (high on 95e6864): ``covers`` trusted the member list of every gathered certificate. One
    admitted identity S joined the honest leader L's search with a certificate of a group that never ran,
    signed by S and keys nobody admitted, listing the honest group H's members; L assembled {L, S} within a
    second of a 20 s window, and H, which ended its first tier 4 s later, found nobody. Now keys the run did
    not admit neither make S's certificate hold nor vouch for anyone, so L waits, and H is in the round."""
    (d_l, k_l), (d_s, k_s), (d_h, k_h) = keyed_dhts
    T = 10.0  # window: until 2T of the members' 4T wait is left, about 20 s
    keys, members, group, vector, facts = first_tier_of(k_l)
    h_keys = [k_h, SigningKey.generate(), SigningKey.generate()]
    h_members = [k.peer_id for k in h_keys]
    # The run's members: L's group, H's group, and S; not the throwaway keys S signs with.
    policy = PeerPolicy(None, prefix, allowed=[*members, *h_members, k_s.peer_id])
    allowed = [*members, *h_members, k_s.peer_id]
    leader = tier_averager(d_l, k_l, prefix, T, policy=policy)
    sybil = tier_averager(d_s, k_s, prefix, T, policy=PeerPolicy(None, prefix, allowed=allowed))
    late = tier_averager(d_h, k_h, prefix, T, policy=PeerPolicy(None, prefix, allowed=allowed))
    # H checks the second tier's entries as every representative does (``SecondTier._tier_fits``).
    h_facts = _Facts(
        os.urandom(20), MINE["step"], MINE["state_hash"], k_h.peer_id, 48.0, bytes(32), tuple(h_members)
    )
    h_fits = SecondTier._tier_fits(SimpleNamespace(averager=late, min_group_size=2), None, h_facts)
    tier = tier_for(leader, k_l)
    here = {*members, *h_members}  # the records at the step: L's group and H's group
    h_vector = torch.randn(NUMEL)
    h_cert = honest_cert(h_keys, 0, 48.0, result_digest(h_vector))
    s_cert = made_up_cert(k_s, 48.0, result_digest(torch.zeros(NUMEL)), h_members)
    assert len(s_cert["members"]) == 7 and len(s_cert["signed"]) == 4, "S, three throwaway keys, H's three"

    async def scenario():
        for a in (leader, sybil, late):
            await a.start()
        sybil.longest_search_s = late.longest_search_s = 4 * T
        started = time.monotonic()

        async def sybil_joins():
            await asyncio.sleep(1.0)  # declares after L: L leads
            return await sybil.average(torch.zeros(NUMEL), 48.0, {**MINE, "group": s_cert}, window_s=2 * T)

        async def honest_group_comes_later():
            await asyncio.sleep(4.0)  # a group that ends its first tier a few seconds later
            return await late.average(h_vector, 48.0, {**MINE, "group": h_cert}, window_s=2 * T, fits=h_fits)

        async def lead():
            out = await represent(tier, keys, members, group, vector, facts, here)
            return out, time.monotonic() - started

        return await asyncio.gather(lead(), sybil_joins(), honest_group_comes_later())

    ((applied, tier_group), took_s), _, h_outcome = asyncio.run(scenario())
    assert tier_group is not None and k_h.peer_id in tier_group, tier_group
    assert k_s.peer_id not in tier_group, (
        "S's certificate does not hold in a run that did not admit its cosigners"
    )
    assert took_s >= 4.0 and applied is not None and h_outcome is not None, "the later honest group came in"


def test_f1b_keys_a_coordinated_run_did_not_admit_vouch_for_nobody_when_a_search_closes():
    """Why one identity sufficed (high on 95e6864): in a run with a coordinator ``listed_refusal`` refuses
    only banned peers, so a certificate's majority may come from keys nobody admitted, and one admitted
    identity certified a made-up group listing 511 honest peers: that one entry closed a 513-peer step's
    search. The certificate still holds (its input is one robust input of the round, its weight capped, as
    before), but its listed members count toward closing only with a majority of admitted signers
    (``SecondTier._counts``: this peer's view of the run's members and records)."""
    coordinator = SigningKey.generate()
    sybil = SigningKey.generate()
    rep = SigningKey.generate()
    own = [rep.peer_id, SigningKey.generate().peer_id]
    honest = [SigningKey.generate().peer_id for _ in range(511)]
    admitted = {sybil.peer_id, *own, *honest}
    policy = PeerPolicy(None, "run", coordinator_key=coordinator.public_key, also_certified=lambda: admitted)
    cert = made_up_cert(sybil, 64.0, bytes(32), honest, throwaway=512)
    assert len(cert["members"]) == 1024
    extra = {**MINE, "group": cert}
    assert certificate_misfit(extra, signer=sybil.peer_id, step=7, state_hash=MINE["state_hash"],
                              refusal=policy.listed_refusal) is None  # fmt: skip

    # The leader's search rule, as ``SecondTier._represent`` builds it, with the tier's real checks.
    tier = SecondTier.__new__(SecondTier)
    tier.averager, tier.min_group_size, tier.absent = SimpleNamespace(policy=policy), 2, MissedRounds()
    facts = _Facts(os.urandom(20), 7, MINE["state_hash"], rep.peer_id, 32.0, bytes(32), tuple(own))
    here = {*own, *honest}
    closing = EarlyClose(
        waiting=lambda: tier._waited_for(lambda: here) - set(own), fits=tier._tier_fits(None, facts),
        counts=tier._counts, step=7, state_hash=MINE["state_hash"], min_members=2,
    )  # fmt: skip
    full = closing_rule(closing, prefix=PREFIX, schema_hash=SCHEMA, signed=True, max_age_s=60.0, limit=64)
    body = GroupEntryBody(schema_hash=SCHEMA, weight=64.0, commit=bytes(32), extra=extra)
    followers = {PeerID.from_base58(sybil.peer_id): SimpleNamespace(gather=make_entry(sybil, PREFIX, body))}
    assert not full(followers), "a made-up list no longer closes the step's window"


# --- finding 2: record-only identities held every multi-group step for the window -----------------------------


def test_f2_record_only_identities_hold_a_representatives_search_once_then_are_not_waited_for(
    keyed_dhts, prefix
):
    """Attack (medium on 95e6864): ``here`` is every peer whose signed record shows the step; an admitted
    identity that publishes records at the step and never joins a group is never covered, and below 20 peers
    the 5% slack is 0, so it held every multi-group step for the whole window (60 s at the run's defaults,
    where the window was about 4 s). Now a step combined without a peer whose record showed it makes that
    peer ``absent``: the next step's search does not wait for it (and a repeat doubles the span). (One such
    identity alone is no longer waited for at all: it could form no group of its own, ``covers``; two are.)"""
    (d_l, k_l), (d_h, k_h), _ = keyed_dhts
    T = 4.0  # window ~8 s
    leader, other = tier_averager(d_l, k_l, prefix, T), tier_averager(d_h, k_h, prefix, T)
    tier = tier_for(leader, k_l)
    h_keys = [k_h, SigningKey.generate(), SigningKey.generate()]
    h_members = [k.peer_id for k in h_keys]
    sybil_records = {SigningKey.generate().peer_id, SigningKey.generate().peer_id}

    async def step():
        keys, members, group, vector, facts = first_tier_of(k_l)
        h_vector = torch.randn(NUMEL)
        h_cert = honest_cert(h_keys, 0, 48.0, result_digest(h_vector))
        started = time.monotonic()

        async def h_joins():
            await asyncio.sleep(0.5)
            return await other.average(h_vector, 48.0, {**MINE, "group": h_cert}, window_s=2 * T)

        (applied, tier_group), _ = await asyncio.gather(
            represent(tier, keys, members, group, vector, facts, {*members, *h_members, *sybil_records}),
            h_joins(),
        )
        return applied, tier_group, time.monotonic() - started

    async def scenario():
        await leader.start()
        await other.start()
        other.longest_search_s = 4 * T
        return await step(), await step()

    (first_applied, first_group, first_took), (then_applied, then_group, then_took) = asyncio.run(scenario())
    window_s = 2 * T
    assert first_applied is not None and set(first_group) == {k_l.peer_id, k_h.peer_id}
    assert first_took >= window_s - 1.0, (
        f"the first step waited {first_took:.1f}s for the record-only identities"
    )
    assert all(tier.absent.strikes(s) == 1 for s in sybil_records), (
        "one strike: the second step went without them"
    )
    assert then_applied is not None and set(then_group) == {k_l.peer_id, k_h.peer_id}
    assert then_took < window_s / 2, f"the next step closed after {then_took:.1f}s of {window_s:.0f}s"


def test_f2b_peers_a_step_was_combined_without_are_waited_for_less_and_less_and_forgiven_by_taking_part():
    """The absence book (``SecondTier.absent``, a ``MissedRounds``): each step combined without a peer whose
    record shows it is a strike; the peer is not waited for at the next 1, 2, 4... steps, and steps in
    which it is in a group forgive a strike. An honest straggler late once costs nothing but one step in
    which nobody waits for it (it still joins if it comes in time)."""
    tier = SecondTier.__new__(SecondTier)
    tier.averager, tier.absent = SimpleNamespace(policy=PeerPolicy(None, "run")), MissedRounds()
    members = [f"m{i}" for i in range(4)]
    group = {"members": members, "signed": [[i, b"s" * 64] for i in range(3)]}
    here = {*members, "ghost"}
    waited = []
    for _ in range(8):
        waited.append("ghost" in tier._waited_for(lambda: here))
        tier._observe(lambda: here, [group], set())
    # Held at steps 0, 2 and 5 (spans of 1 and 2 steps after the first two strikes), not at the others.
    assert waited == [True, False, True, False, False, True, False, False], waited
    assert all(tier.absent.refusal(m) is None for m in members), "peers in the step's groups are waited for"


# --- finding 3: per-join certificate verification inside hivemind's join lock ---------------------------------


def test_f3_a_join_whose_claims_would_not_close_the_window_costs_no_certificate_check(monkeypatch):
    """Low on 95e6864: ``closing_rule`` ran the tier's ``fits`` (up to 1,024 Ed25519 verifications for a
    certificate of 1,024 members signed by throwaway keys) for every joining identity, inside hivemind's join
    lock. Now the rule is first asked of the entries as they claim, and the claims are checked only when
    they would close the window: such a join costs one signature, and a claim that would close it is checked
    once per search."""
    coordinator = SigningKey.generate()
    policy = PeerPolicy(None, "run", coordinator_key=coordinator.public_key, allowed=[])
    sybil = SigningKey.generate()
    cert = made_up_cert(sybil, 64.0, bytes(32), [], throwaway=1023)
    assert len(cert["signed"]) == 1024
    calls = []
    real = tiercert.attestation_holds

    def counting(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(tiercert, "attestation_holds", counting)
    rep = SigningKey.generate()
    tier = SecondTier.__new__(SecondTier)
    tier.averager, tier.min_group_size, tier.absent = SimpleNamespace(policy=policy), 2, MissedRounds()
    facts = _Facts(os.urandom(20), 7, MINE["state_hash"], rep.peer_id, 32.0, bytes(32), (rep.peer_id, "x"))
    body = GroupEntryBody(schema_hash=SCHEMA, weight=64.0, commit=bytes(32), extra={**MINE, "group": cert})
    followers = {PeerID.from_base58(sybil.peer_id): SimpleNamespace(gather=make_entry(sybil, PREFIX, body))}

    def rule(waiting: set[str]):
        closing = EarlyClose(waiting=lambda: waiting, fits=tier._tier_fits(None, facts), counts=lambda p: True,
                             step=7, state_hash=MINE["state_hash"], min_members=2)  # fmt: skip
        return closing_rule(closing, prefix=PREFIX, schema_hash=SCHEMA, signed=True, max_age_s=60.0, limit=64)

    never = rule({"someone-else", "another"})
    assert not never(followers) and not never(followers)
    assert calls == [], f"{len(calls)} certificate signatures checked for claims that close nothing"
    would = rule(set(cert["members"][:10]))
    assert would(followers) and would(followers)
    assert len(calls) >= 1024, "a claim that would close the window is checked, once per search"
    assert len(calls) <= 2 * 1024


# --- finding 4: ``here`` was one snapshot of the records, taken before the window opened -----------------------


def test_f4_the_peers_to_wait_for_are_read_from_the_records_again_at_each_join(monkeypatch):
    """Low on 95e6864: ``TrainingPeer._round`` computed ``here`` once, from the progress view at the end of
    this peer's first tier; a group whose members' records still showed the step before at that moment was
    never waited for, and nothing refreshed it during a window of up to a minute. Now ``here`` is read again
    at each join: records that reach the step meanwhile are waited for."""
    from swarm.training.catchup import Groupmates
    from swarm.training.peer import TrainingPeer

    others = [SimpleNamespace(peer_id=p, step=7) for p in ("m1", "m2", "g1", "g2", "g3")]
    others += [SimpleNamespace(peer_id=p, step=6) for p in ("late1", "late2", "late3")]  # records lag
    seen: dict = {}

    async def average(vector, weight, extra, **kwargs):
        group = SimpleNamespace(peer_ids=["me", "m1", "m2"], extras=[extra] * 3, excluded=[])
        return group, RoundResult(vector, True)

    async def combine(group, result, *, peers_at_step, here, **kwargs):
        seen.update(peers_at_step=peers_at_step, before=set(here()))
        for p in others:
            p.step = 7  # the lagging records arrive while the tier searches
        seen.update(after=set(here()))

    peer = SimpleNamespace(
        view={p.peer_id: p for p in others}, peer_id="me", step=7, samples=32,
        config=SimpleNamespace(training=SimpleNamespace(min_group_size=2)),
        hooks=SimpleNamespace(contribute=lambda peer, v: v, weight=lambda w: w, entry=lambda e: e),
        strategy=SimpleNamespace(contribution=lambda s: torch.zeros(4), weight=lambda s: float(s)),
        _own_contribution=lambda: torch.zeros(4),  # TrainingPeer._own_contribution, finite
        _round_extra=lambda: dict(MINE), averager=SimpleNamespace(average=average), _averaged=None,
        policy=SimpleNamespace(refusal=lambda p: None, member_count=lambda: 0, refresh_members=lambda: asyncio.sleep(0)),
        _searches=FailedSearches(), _stats={"last_round_s": 0.0, "averaging_s": 0.0, "rounds_failed": 0},
        _journal=lambda *a, **k: None, _adopt=lambda extra: asyncio.sleep(0, False),
        _group_usable=lambda group: True, tiers=SimpleNamespace(combine=combine), _ahead=lambda: [], _showing=set,
        sender_checks=SimpleNamespace(enabled=False), groupmates=Groupmates(),
    )  # fmt: skip
    asyncio.run(TrainingPeer._round(peer))
    assert seen["peers_at_step"] == 9, "the lagging group is counted as coming"
    assert seen["before"] == {"m1", "m2", "g1", "g2", "g3"}
    assert seen["after"] == {"m1", "m2", "g1", "g2", "g3", "late1", "late2", "late3"}, "read again"
