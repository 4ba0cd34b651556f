"""Ways in found by reading the trust work as an attacker would, each with the real classes: the attack,
where the flaw was, what it did before, and that it no longer does (each test failed on the old code)."""

from __future__ import annotations

import asyncio
import hashlib
import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from hivemind.p2p import PeerID

from protocols.envelope import seal
from protocols.keys import SigningKey
from swarm.averaging.averager import Averager
from swarm.averaging.groups import GROUP_ENTRY
from swarm.averaging.policy import PeerPolicy
from swarm.training.trainer import step_misfit

pytestmark = pytest.mark.timeout(120)

RUN = "review-run"
PREFIX = "review-run"
SCHEMA = hashlib.sha256(b"schema").digest()
H_OLD = "1" * 64


def _entry(key: SigningKey, step: int, *, now: float | None = None, prefix: str = PREFIX) -> bytes:
    """A group entry exactly as ``Averager.find_group`` signs one (weight 8, step in ``extra``)."""
    body = {
        "schema_hash": SCHEMA, "weight": 8.0, "commit": os.urandom(32), "data": None,
        "extra": {"step": step, "state_hash": H_OLD},
    }  # fmt: skip
    return seal(key, GROUP_ENTRY, prefix, body, now=now)


def _averager_of(me: SigningKey, leader: SigningKey, members: list[str], my_entry: bytes) -> Averager:
    """The real ``Averager._checked`` without a daemon: only what it reads is set (as in
    tests/test_step_claims_redteam.py). ``members``: the peers certified in this peer's view."""
    averager = object.__new__(Averager)
    averager.p2p = SimpleNamespace(peer_id=PeerID.from_base58(me.peer_id))
    averager.matchmaking = SimpleNamespace(leader=PeerID.from_base58(leader.peer_id))
    averager.policy = PeerPolicy(None, RUN, allowed=members)
    averager.prefix, averager.schema_hash, averager.signing_key = PREFIX, SCHEMA, me
    averager._entry = my_entry
    averager.averaging_timeout_s, averager.matchmaking_time_s = 30.0, 2.0
    averager.min_reducers, averager.max_weight = 1, 1e9
    return averager


def _info(members: list[str], gathered: dict[str, bytes]) -> SimpleNamespace:
    """What hivemind hands a follower once its leader begins the round: the leader's list and entries."""
    return SimpleNamespace(
        peer_ids=[PeerID.from_base58(p) for p in members],
        gathered=[gathered[p] for p in members],
        group_id=os.urandom(16),
    )


# --- 1. a leader breaks every group it leads and the blame lands on a phantom -----------------------


def test_a_leader_listing_a_phantom_member_is_blamed_for_it_and_the_phantom_is_not():
    """Attack: a certified Sybil leader gathers honest followers, then announces the group with one extra
    member, a freshly generated key that no coordinator ever certified (its "entry" is junk bytes).
    Flaw (swarm/averaging/groups.py:check_group): a listed member that is not admitted was named the
    culprit, so every follower left the group, suspected the phantom, and followed the same leader again:
    20 groups in a row broken for both honest followers, and 20 phantom keys in each one's suspect book.
    Now the leader that listed it is blamed (avoided as a leader), and the phantom never enters the book."""
    leader, b, c = (SigningKey.generate() for _ in range(3))
    certified = [leader.peer_id, b.peer_id, c.peer_id]
    followers = {me.peer_id: (me, _entry(me, 11)) for me in (b, c)}
    averagers = {p: _averager_of(me, leader, certified, e) for p, (me, e) in followers.items()}
    for _ in range(20):
        phantom = SigningKey.generate()  # free: never joined, never certified
        members = [leader.peer_id, b.peer_id, c.peer_id, phantom.peer_id]
        gathered = {leader.peer_id: _entry(leader, 11), phantom.peer_id: b"junk"}
        gathered.update({p: e for p, (_, e) in followers.items()})
        for averager in averagers.values():
            group = asyncio.run(
                averager._checked(_info(members, gathered), lambda e: step_misfit(e.extra, {"step": 11}))
            )
            assert group is None, "a group with a member that is not admitted is still left"
            assert averager.policy.suspects.get(phantom.peer_id) is None, "the phantom takes no blame"
            assert averager.policy.refusal(leader.peer_id, as_leader=True) is not None, "its leader does"
    for averager in averagers.values():
        assert set(averager.policy.suspects._held) == {leader.peer_id}, "the book holds the leader alone"


# --- 2. two Sybils pad a laggard's group so that it suspects the honest peers ahead ------------------


def test_two_sybils_at_a_laggards_step_cannot_make_it_suspect_the_honest_peers_ahead():
    """Attack: a Sybil leader announces to an honest laggard V (step 10) a group of V, two Sybils signing
    step 10, and the fresh step-11 entries of honest B and C it received in an earlier group with them.
    Flaw: the misfits B and C were 2 of 5 (under half of ``VerifiedGroup.suspects``' count, which counts
    the Sybils the leader adds), so V suspected both honest peers ahead for 60 to 960 s and, once caught
    up, expected neither in its next round. Now a step ahead that the run's signed progress records hold
    (``step_misfit``'s ``held``) blames nobody: V is the laggard."""
    v, b, c, s1, s2 = (SigningKey.generate() for _ in range(5))
    members = [s1.peer_id, s2.peer_id, v.peer_id, b.peer_id, c.peer_id]
    gathered = {s1.peer_id: _entry(s1, 10), s2.peer_id: _entry(s2, 10), v.peer_id: _entry(v, 10),
                b.peer_id: _entry(b, 11, now=time.time() - 20), c.peer_id: _entry(c, 11, now=time.time() - 20)}  # fmt: skip
    averager = _averager_of(v, s1, members, gathered[v.peer_id])
    held = {11}  # V's view: B and C published signed progress records at step 11
    group = asyncio.run(
        averager._checked(_info(members, gathered), lambda e: step_misfit(e.extra, {"step": 10}, held))
    )
    assert group is not None and {str(p) for p in group.peer_ids} == {s1.peer_id, s2.peer_id, v.peer_id}
    assert averager.policy.refusal(b.peer_id) is None and averager.policy.refusal(c.peer_id) is None
    # V caught up to step 11 by download; its trainer's expected group (Trainer._round's ``at_step``):
    at_step = [p for p in (b.peer_id, c.peer_id, s1.peer_id) if averager.policy.refusal(p) is None]
    assert at_step == [b.peer_id, c.peer_id, s1.peer_id], "both honest peers ahead are expected again"
    # A claim ahead that no progress record holds is still a lie, and blamed while the liars are few.
    misfit = step_misfit({"step": 12}, {"step": 10}, held)
    assert misfit is not None and misfit.blamed


# --- 4. four admitted identities hold every state upload slot of a holder, forever ------------------


@pytest.mark.timeout(120)
def test_admitted_identities_that_never_read_free_the_state_upload_slots_they_took(monkeypatch):
    """Attack: four certified Sybils each open one ``rpc_download_state`` stream to an honest holder, send
    the request, and never read the reply, to hold every upload slot. Flaw: the holder's handler blocked
    in its write with no deadline (swarm/inbound.py:BoundedServicer._pump timed only the first request),
    so 4 of 4 slots stayed held 35 s after the streams opened, and every honest requester (a joining or
    stalled peer, the coordinator's checkpoint keeper) was refused "already serves 4 state downloads".
    Now each reply must be taken within ``transfer_within_s`` of its size (shortened here): the Sybils'
    streams end, their slots free, and the honest peer downloads the state."""
    import torch
    from hivemind.p2p import P2P

    import swarm.inbound
    from protocols import averaging_pb2 as apb
    from swarm.training.state import encode_state, state_hash
    from swarm.training.sync import MAX_UPLOADS, EncodedState, StateServicer, download_state, state_namespace

    # 10 s plus a chunk at 1 Mbit/s in a run; 2 s here, so that the test does not wait for it.
    monkeypatch.setattr(swarm.inbound, "FIRST_REQUEST_TIMEOUT_S", 1.0)
    monkeypatch.setattr(swarm.inbound, "FIRST_REQUEST_MIN_BYTES_PER_S", 1 << 20)
    tensors = {"w": torch.arange(12 << 20, dtype=torch.float32)}  # 48 MiB: more than the daemons buffer
    state = EncodedState(7, state_hash(7, tensors), encode_state(7, tensors, {"run_id": RUN}))
    name = StateServicer._get_handle_name(state_namespace(RUN), "rpc_download_state")

    async def provide() -> EncodedState:
        return state

    async def admit(requester: str) -> str | None:
        return None  # every requester here is a certified, unbanned member of the run

    async def scenario():
        holder = await P2P.create()
        servicer = StateServicer(RUN, provide, admit=admit)
        await servicer.add_p2p_handlers(holder, namespace=state_namespace(RUN))
        maddrs = await holder.get_visible_maddrs()
        sybils = [await P2P.create(initial_peers=maddrs) for _ in range(MAX_UPLOADS)]
        honest = await P2P.create(initial_peers=maddrs)
        streams = []
        try:
            for sybil in sybils:  # one stream each: the per-requester limit is 1
                _, reader, writer = await sybil.call_binary_stream_handler(holder.peer_id, name)
                await P2P.send_protobuf(apb.StateRequest(run_id=RUN, min_step=7), writer)
                await P2P.send_protobuf(P2P.END_OF_STREAM, writer)
                streams.append((reader, writer))  # ... and never read from ``reader``
            await asyncio.sleep(1.0)
            taken = sum(servicer.uploads.values())
            started = time.monotonic()
            while servicer.uploads and time.monotonic() - started < 60:
                await asyncio.sleep(0.2)
            freed_s = time.monotonic() - started
            decoded = await download_state(honest, holder.peer_id, namespace=state_namespace(RUN), run_id=RUN,
                                           min_step=7, expected_hash=state.state_hash, max_bytes=len(state.data) * 2,
                                           timeout_s=30)  # fmt: skip
            return taken, freed_s, decoded
        finally:
            for _, writer in streams:
                writer.close()
            for p in (*sybils, honest, holder):
                await p.shutdown()

    taken, freed_s, decoded = asyncio.run(scenario())
    assert taken == MAX_UPLOADS, "the Sybils did take every slot"
    assert freed_s < 30, f"their slots stayed held {freed_s:.0f}s"
    assert decoded.step == 7 and torch.equal(decoded.tensors["w"], tensors["w"])


def test_phantom_members_cannot_flush_a_real_withholder_out_of_a_followers_suspect_book():
    """Attack: as in the phantom test above, a Sybil leader breaks groups by listing a fresh uncertified
    key each time, to push a real withholder W (avoided on its third strike: 240 s) out of the follower's
    suspect book, which forgets its oldest entry at ``MAX_SUSPECTS``. Flaw: each broken group put one
    phantom in the book (swarm/averaging/groups.py:check_group named it), so after 4,096 of them W was
    followed again and its next offence counted as a first one. Now each break blames the one leader."""
    from swarm.averaging.policy import MAX_SUSPECTS

    leader, b, w = (SigningKey.generate() for _ in range(3))
    my_entry = _entry(b, 11)
    averager = _averager_of(b, leader, [leader.peer_id, b.peer_id, w.peer_id], my_entry)
    policy = averager.policy
    for _ in range(3):  # W withheld its part three times in a row: 60 s, 120 s, then 240 s
        held = policy.suspects.get(w.peer_id)
        if held is not None:  # let its avoid period end, within the repeat window
            policy.suspects._held[w.peer_id] = held.__class__(
                time.monotonic() - 1, held.reason, False, held.strikes
            )
        policy.blame_round([w.peer_id], [])
    assert policy.suspects.get(w.peer_id).strikes == 3 and policy.refusal(w.peer_id) is not None
    fits = lambda e: step_misfit(e.extra, {"step": 11})  # noqa: E731
    leader_entry = _entry(leader, 11)

    async def flood():
        for _ in range(MAX_SUSPECTS):
            phantom = SigningKey.generate()  # never certified; its "entry" is junk
            members = [leader.peer_id, b.peer_id, phantom.peer_id]
            info = _info(
                members, {leader.peer_id: leader_entry, b.peer_id: my_entry, phantom.peer_id: b"junk"}
            )
            assert await averager._checked(info, fits) is None

    asyncio.run(flood())
    assert policy.refusal(w.peer_id) is not None, "the withholder is still avoided"
    assert policy.suspects.get(w.peer_id).strikes == 3, "and its strikes are kept"
    assert policy.refusal(leader.peer_id, as_leader=True) is not None
    assert len(policy.suspects) == 2, "the book holds the withholder and the leader"


# --- Sybil-on-Sybil convictions and the published ban list ------------------------------------------


@pytest.mark.timeout(300)
def test_convictions_fabricated_among_sybils_cannot_push_a_real_cheaters_conviction_off_the_ban_list(
    tmp_path: Path,
):
    """Attack: Sybils make up rounds among themselves (no honest peer, no network round) in which one
    Sybil reducer shifts its aggregate and another files the true evidence: each is a real conviction.
    Flaw (coordinator/banlist.py:enforced_bans_sync): the list ranked convictions newest first, so
    ``MAX_BANNED`` (25,600) of them within a real cheater's certificate lifetime pushed its conviction off
    the signed list every peer enforces (25,600 joins: 8 addresses at the default challenge rate for an
    hour). Now a conviction ranks by how many earlier ones its accuser's address brought: the flock's
    convictions from 8 addresses rank behind a conviction from any other address."""
    from test_sybil_coordinator import admitted, serving, true_accusation

    from coordinator.limits import ServiceLimits
    from swarm.bans import MAX_BANNED

    flock = [f"10.0.{i}.0/24" for i in range(8)]  # the Sybils' addresses, as ``caller_key`` names them

    async def scenario():
        async with serving(tmp_path, ServiceLimits()) as (address, store, service):
            accuser, cheater, third, s_accuser, s_third, *s_reducers = await admitted(address, 8)
            for s in s_reducers:  # made-up rounds of three Sybils, convicted through the service first
                answer = await true_accusation(address, service, s_accuser, s, s_third)
                assert answer.banned_peer == s.peer_id and "differs" in answer.verdict
            # The rest of the flock, as the service records a conviction from each of its addresses.
            await store._run(lambda db: db.execute("PRAGMA synchronous=OFF"))
            for i in range(MAX_BANNED):
                await store.ban(SigningKey.generate().peer_id, "part 1 chunk 0: differs from the rule's result",
                                b"evidence", max_stored_evidence_bytes=0, accuser_address=flock[i % 8])  # fmt: skip
            # The real cheat comes last, filed from the honest accuser's own address (a loopback one here).
            answer = await true_accusation(address, service, accuser, cheater, third)
            assert answer.banned_peer == cheater.peer_id
            listed = await store.enforced_bans(time.time(), grace_s=600)
            return listed, await store.get_peer(cheater.peer_id)

    listed, cheater_row = asyncio.run(scenario())
    assert len(listed) > MAX_BANNED
    assert cheater_row.peer_id in listed[:MAX_BANNED], "what coordinator/node.py:_publish_bans signs"
    assert cheater_row.cert_expires_at > time.time() + 300, "while its certificate is valid"
