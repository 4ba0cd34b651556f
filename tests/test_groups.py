"""Averaging groups are made of certified, unbanned, distinct peers whose entries they signed themselves."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os

import pytest
import torch

from protocols.envelope import seal
from protocols.keys import SigningKey
from swarm.averaging.averager import Averager
from swarm.averaging.groups import GROUP_ENTRY, GroupEntryBody, GroupRefused, check_group, make_entry
from swarm.averaging.policy import PeerPolicy
from swarm.byzantine.attacks import make_attack
from swarm.byzantine.group_attacks import _with_commitment
from swarm.training.progress import step_misfit

pytestmark = pytest.mark.timeout(180)

PREFIX = "groups-run"
SCHEMA = hashlib.sha256(b"schema").digest()
NUMEL = 30_011


def entry(key: SigningKey, weight: float = 1.0, **fields) -> bytes:
    body = {"schema_hash": SCHEMA, "weight": weight, "commit": os.urandom(32), "data": None, "extra": {}}
    return seal(key, GROUP_ENTRY, PREFIX, {**body, **fields})


def check(ids, gathered, me=0, refusal=lambda peer: None, max_age_s=60.0, leader=None):
    return check_group(
        [k.peer_id for k in ids], gathered, me=ids[me].peer_id, my_entry=gathered[me],
        leader=leader or ids[-1].peer_id, prefix=PREFIX, schema_hash=SCHEMA, signed=True, refusal=refusal,
        max_age_s=max_age_s,
    )  # fmt: skip


@pytest.fixture(scope="module")
def ids():
    return [SigningKey.generate() for _ in range(3)]


def test_a_group_of_signed_entries_is_kept_whole_in_the_leaders_order(ids):
    gathered = [entry(k, weight=i + 1.0) for i, k in enumerate(ids)]
    group = check(ids, gathered)
    assert group.peer_ids == [k.peer_id for k in ids] and not group.excluded
    assert [e.weight for e in group.entries] == [1.0, 2.0, 3.0]


def test_a_rewritten_commitment_excludes_that_member_only(ids):
    gathered = [entry(k) for k in ids]
    gathered[1] = _with_commitment(gathered[1], os.urandom(32))
    group = check(ids, gathered)
    assert group.peer_ids == [ids[0].peer_id, ids[2].peer_id]
    assert "signature" in group.excluded[ids[1].peer_id]


@pytest.mark.parametrize(
    "forge, reason",
    [
        (lambda keys: entry(keys[2]), "is signed by"),  # another member's key
        (lambda keys: make_entry(None, PREFIX, GroupEntryBody(schema_hash=SCHEMA, weight=1.0, commit=b"c" * 32)),
         "group entry"),  # unsigned
        (lambda keys: seal(keys[1], GROUP_ENTRY, PREFIX, {"schema_hash": SCHEMA, "weight": 1.0, "extra": {}}),
         "'commit'"),  # no commitment
        (lambda keys: entry(keys[1], commit=b"short"), "'commit'"),
        (lambda keys: entry(keys[1], weight=float("nan")), "'weight'"),
        (lambda keys: entry(keys[1], data="not an address"), "not host:port"),
        (lambda keys: entry(keys[1], schema_hash=hashlib.sha256(b"other").digest()), "another averaging schema"),
        (lambda keys: seal(keys[1], GROUP_ENTRY, "another-run", {}), "for run 'another-run'"),
    ],
)  # fmt: skip
def test_a_member_whose_entry_fails_is_excluded_with_the_reason(ids, forge, reason):
    gathered = [entry(k) for k in ids]
    gathered[1] = forge(ids)
    group = check(ids, gathered)
    assert ids[1].peer_id not in group.peer_ids and len(group.peer_ids) == 2
    assert reason in group.excluded[ids[1].peer_id]


def test_every_member_at_the_step_excludes_the_same_misfit_and_keeps_the_rest(ids):
    """The rule DiLoCo applies to signed outer steps: each honest member, from the same signed bytes,
    keeps the same members; the misfit is named for suspicion."""
    gathered = [entry(k, extra={"step": 4}) for k in ids]
    for claim in (5, 3, True, "4", None):  # True == 1 in Python, but it is no step
        gathered[1] = entry(ids[1], extra={} if claim is None else {"step": claim})
        for me in (0, 2):
            group = check_group(
                [k.peer_id for k in ids], gathered, me=ids[me].peer_id, my_entry=gathered[me],
                leader=ids[0].peer_id, prefix=PREFIX, schema_hash=SCHEMA, signed=True, refusal=lambda p: None,
                max_age_s=60.0, fits=lambda e, _signer: step_misfit(e.extra, {"step": 4}),
            )  # fmt: skip
            assert group.peer_ids == [ids[0].peer_id, ids[2].peer_id], claim
            assert f"claims step {claim}, not this round's 4" in group.misfits[ids[1].peer_id]
            assert group.excluded.keys() == group.misfits.keys() == {ids[1].peer_id}


def test_members_claiming_another_step_are_excluded_and_only_a_minority_claiming_ahead_is_suspected():
    """every_step and DiLoCo alike (issue 25 item 3). Before, in every_step, two members of four whose signed
    entries claimed step s+1 made the honest members skip the round, nobody blamed, and a peer whose rounds
    kept failing so then let the peers ahead decide its catch-up. Now each member keeps the members at its
    step. It suspects a misfit only for a claim ahead (a step behind is what an honest laggard signs, and
    what a leader replaying a member's older entry shows) and only while the misfits are fewer than half
    of the group (two of four is as much a laggard with a Sybil at its step as two honest peers with two
    liars)."""
    keys = [SigningKey.generate() for _ in range(4)]
    names = [k.peer_id for k in keys]

    def seen_by(me: int, steps: list[int]):
        gathered = [entry(k, extra={"step": s}) for k, s in zip(keys, steps, strict=True)]
        return check_group(
            names, gathered, me=names[me], my_entry=gathered[me], leader=names[0], prefix=PREFIX,
            schema_hash=SCHEMA, signed=True, refusal=lambda p: None, max_age_s=60.0,
            fits=lambda e, _signer: step_misfit(e.extra, {"step": steps[me]}),
        )  # fmt: skip

    for me in (0, 1, 2):
        group = seen_by(me, [2, 2, 2, 3])  # one liar ahead
        assert group.peer_ids == names[:3] and group.suspects.keys() == {names[3]}
    for me in (0, 1):
        group = seen_by(me, [2, 2, 3, 3])  # two of four: excluded, the round goes on, nobody blamed
        assert group.peer_ids == names[:2] and group.misfits.keys() == {names[2], names[3]}
        assert group.suspects == {}
    group = seen_by(1, [2, 3, 3, 3])  # a laggard (or a replayed older entry of it): excluded, not blamed
    assert group.peer_ids == names[1:] and group.misfits.keys() == {names[0]} and group.suspects == {}
    group = seen_by(0, [2, 3, 3, 3])  # the laggard itself: the odd one out, it blames nobody
    assert group.peer_ids == names[:1] and group.suspects == {}


def test_a_stale_entry_is_excluded(ids):
    gathered = [entry(k) for k in ids]
    gathered[1] = seal(ids[1], GROUP_ENTRY, PREFIX, {"schema_hash": SCHEMA, "weight": 1.0, "commit": b"c" * 32,
                                                     "data": None, "extra": {}}, now=0.0)  # fmt: skip
    assert "old" in check(ids, gathered).excluded[ids[1].peer_id]


def test_a_repeated_member_or_an_altered_own_entry_leaves_the_group_naming_the_leader(ids):
    leader = ids[2].peer_id
    gathered = [entry(k) for k in ids]
    with pytest.raises(GroupRefused, match=f"listed {leader} 3 times") as refused:
        check(ids + [ids[2], ids[2]], gathered + [gathered[2], gathered[2]])
    assert refused.value.culprit == leader
    mine = gathered[0]
    gathered[0] = entry(ids[0])
    with pytest.raises(GroupRefused, match="altered this peer's signed entry") as refused:
        check_group(
            [k.peer_id for k in ids], gathered, me=ids[0].peer_id, my_entry=mine, leader=leader, prefix=PREFIX,
            schema_hash=SCHEMA, signed=True, refusal=lambda peer: None, max_age_s=60.0,
        )  # fmt: skip
    assert refused.value.culprit == leader


def test_an_uncertified_or_banned_member_leaves_the_group_blaming_the_leader_that_listed_it(ids):
    policy = PeerPolicy(None, PREFIX, allowed={ids[0].peer_id, ids[2].peer_id})
    gathered = [entry(k) for k in ids]
    with pytest.raises(GroupRefused, match="not a certified member") as refused:
        check(ids, gathered, refusal=policy.refusal)
    assert refused.value.culprit == ids[2].peer_id, "the leader listed it: the listed peer is not to blame"
    policy = PeerPolicy(None, PREFIX, allowed={k.peer_id for k in ids})
    assert check(ids, gathered, refusal=policy.refusal).peer_ids == [k.peer_id for k in ids]
    policy.set_bans({ids[2].peer_id}, issued_at=10.0)
    with pytest.raises(GroupRefused, match="banned by the coordinator"):
        check(ids, gathered, refusal=policy.refusal)


def test_the_ban_state_changes_only_through_a_newer_signed_list():
    policy = PeerPolicy(None, PREFIX, allowed={"c", "d"})
    assert policy.set_bans({"a", "b"}, issued_at=5.0) == {"a", "b"}
    assert policy.set_bans(set(), issued_at=4.0) == set() and policy.banned == {"a", "b"}, (
        "an old list is stale"
    )
    policy.set_bans({"b"}, issued_at=6.0)
    assert policy.banned == frozenset({"b"}) and isinstance(policy.banned, frozenset)
    policy.suspect("c", "it broke a group")
    assert "broke a group" in policy.refusal("c")
    policy.suspect("d", "it altered an entry", leader_only=True)  # only a leader can do that
    assert policy.refusal("d") is None and "as a leader" in policy.refusal("d", as_leader=True)


# --- real peers: a malicious leader among three DHT processes ------------------------------------------


@pytest.fixture
def peers(keyed_dhts):
    return keyed_dhts


def build(dht, key, allowed, prefix: str, hooks=None) -> Averager:
    return Averager(
        dht, prefix=prefix, numel=NUMEL, signing_key=key, matchmaking_time_s=1.0, data_plane=False,
        aggregator="centered_clip", sender_timeout_s=2.0, averaging_timeout_s=10.0,
        policy=PeerPolicy(dht, prefix, allowed=allowed), hooks=hooks,
    )  # fmt: skip


async def attacked_then_retried(honest: list[Averager], attacker: Averager, inputs: list[torch.Tensor]):
    """The attacker looks for a group first (so it leads), then the honest peers; they retry until done."""
    for averager in (*honest, attacker):
        await averager.start()
    attack = asyncio.create_task(attacker.average(torch.full((NUMEL,), 100.0), 1.0))
    await asyncio.sleep(0.3)
    first = await asyncio.gather(*[a.average(v, 1.0) for a, v in zip(honest, inputs, strict=True)])
    with_attacker = await attack
    retries = []
    for _ in range(3):
        retries = await asyncio.gather(*[a.average(v, 1.0) for a, v in zip(honest, inputs, strict=True)])
        if all(o is not None and o[1].complete for o in retries):
            break
    for averager in (*honest, attacker):
        await averager.shutdown()
    return first, with_attacker, retries


@pytest.mark.parametrize(
    "attack, reason",
    [
        ("duplicate_member", "listed {leader} 3 times"),
        ("rewrite_commitments", "altered this peer's signed entry"),
    ],
)
def test_a_malicious_leader_is_left_and_the_honest_peers_average_without_it(peers, caplog, attack, reason):
    allowed = {k.peer_id for _, k in peers}
    (d0, k0), (d1, k1), (d2, k2) = peers
    prefix = f"{PREFIX}-{attack}"
    honest = [build(d0, k0, allowed, prefix), build(d1, k1, allowed, prefix)]
    attacker = build(d2, k2, allowed, prefix, hooks=make_attack(attack, group_size=3, attackers=1))
    generator = torch.Generator().manual_seed(0)
    inputs = [torch.randn(NUMEL, generator=generator) for _ in range(2)]
    with caplog.at_level(logging.WARNING):
        first, _, retries = asyncio.run(attacked_then_retried(honest, attacker, inputs))

    leader = k2.peer_id
    assert first == [None, None], "both honest peers leave the group the attacker announced"
    assert caplog.text.count(reason.format(leader=leader)) >= 2, "each honest peer logs the culprit"
    (group, result), (_, other) = retries
    assert [p.to_base58() for p in group.peer_ids] != [] and leader not in {
        p.to_base58() for p in group.peer_ids
    }
    assert result.complete and other.complete and not result.dropped
    assert torch.equal(result.vector, other.vector), "honest peers stay bit-identical"
    assert torch.allclose(result.vector, (inputs[0] + inputs[1]) / 2, atol=2e-3), (
        "nothing of the attacker's 100s"
    )
