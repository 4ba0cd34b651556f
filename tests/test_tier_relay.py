"""The second tier's hand-off down a tree of the group's members: who asks whom (``relay_order``,
``relay_parent``), and, over real libp2p peers, that a relayed outcome is the representative's, that the
representative still gets every member's attestation, and that a relayer that lies, fails or says ``alone``
costs its members only a question to the representative."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch
from test_tiers import PREFIX
from tier_relay_helpers import handoff, peers, shutdown

from protocols import averaging_pb2 as apb
from protocols.keys import SigningKey
from swarm.averaging.tiers import TierCheck, TierOutcome, relay_order, relay_parent, representative
from swarm.averaging.tierserve import fetch_down_the_tree


def test_the_relay_tree_bounds_what_each_member_sends_and_reaches_everyone_in_few_hops():
    names = [SigningKey.generate().peer_id for _ in range(64)]
    commitments = [os.urandom(32) for _ in names]
    dialable = [i % 5 != 0 for i in range(64)]  # every fifth member is behind NAT
    order = relay_order(commitments, names, dialable)
    assert order[0] == representative(commitments, names, dialable), "the tree's root is the representative"
    assert sorted(order) == list(range(64)) and all(dialable[i] for i in order[:51]), "dialable ones first"
    parents = {i: relay_parent(order, i, dialable, 4) for i in order[1:]}
    children: dict[int, int] = {}
    for parent in parents.values():
        children[parent] = children.get(parent, 0) + 1
    assert all(dialable[p] for p in parents.values()), "nobody asks a member it cannot dial"
    assert max(children.values()) <= 4, "each member sends the outcome at most fanout times"
    for member in order[1:]:
        hops, at = 0, member
        while at != order[0]:
            at, hops = parents[at], hops + 1
        assert hops <= 3, "64 members are reached in log4(64) = 3 hops"
    assert relay_order(list(reversed(commitments)), names, dialable) == order, (
        "the leader's order moves nothing"
    )
    chain = relay_order(commitments[:3], names[:3], None)
    assert (
        relay_parent(chain, chain[2], None, 1) == chain[1]
        and relay_parent(chain, chain[1], None, 1) == chain[0]
    )
    assert relay_parent(chain, chain[2], [True, True, True], 4) == chain[0], (
        "a fanout as large as the group: all ask the root"
    )


@pytest.mark.timeout(120)
def test_a_member_gets_the_representatives_outcome_through_its_relayer_and_around_one_that_lies():
    outcome, expected, checks = handoff()
    check = checks(60.0)

    async def scenario():
        rep, relayer, member = nodes = await peers(3)
        try:
            members = [n.id for n in nodes]

            async def fetch(group_id: bytes, attestation: bytes) -> TierCheck | None:
                return await fetch_down_the_tree(
                    member.p2p, PREFIX, apb.TierRequest(group_id=group_id, attestation=attestation),
                    representative=rep.p2p.peer_id, parent=relayer.p2p.peer_id, check=check, timeout_s=20.0,
                    chunk_timeout_s=5.0, traffic=member.traffic, suspect=member.suspect,
                )  # fmt: skip

            # An honest relayer: it checked the outcome itself and passes it on; the representative still
            # gets the member's attestation, sent alone.
            for node in nodes:
                await node.serve(members)
            group_id = os.urandom(20)
            rep.board.open(group_id, members, holds=lambda who, signature: signature == who.encode())
            rep.board.post(group_id, outcome)
            relayer.board.relay(group_id, [member.id])
            relayed = asyncio.create_task(fetch(group_id, member.id.encode()))
            await asyncio.sleep(0.5)
            relayer.board.post(group_id, outcome)
            got = await relayed
            assert torch.equal(got.output, expected), "the member applies exactly what the second tier signed"
            assert await rep.board.majority(group_id, timeout_s=1.0) is None, "one attestation of three"
            rep.board.attest(group_id, rep.id, rep.id.encode())
            assert await rep.board.majority(group_id, timeout_s=1.0) == {
                0: rep.id.encode(),
                2: member.id.encode(),
            }
            assert relayer.traffic.sent > 0 and rep.traffic.sent == 0, "the representative sent it to nobody"
            assert not member.suspected

            # A relayer that alters a chunk: suspected, and the member gets the outcome from the representative.
            forged_chunks = [list(part) for part in outcome.chunks]
            forged = apb.PartChunk()
            forged.CopyFrom(forged_chunks[0][0])
            forged.data = bytes(len(forged.data))
            forged_chunks[0][0] = forged
            group_id = os.urandom(20)
            rep.board.open(group_id, members, holds=lambda who, signature: True)
            rep.board.post(group_id, outcome)
            relayer.board.relay(group_id, [member.id])
            relayer.board.post(group_id, TierOutcome(**{**outcome.__dict__, "chunks": forged_chunks}))
            got = await fetch(group_id, b"")
            assert torch.equal(got.output, expected)
            assert [p for p, _ in member.suspected] == [relayer.id] and "part 0 chunk 0" in member.suspected[
                0
            ][1], member.suspected

            # A relayer that says alone, or has nothing: only the representative may say so; it is asked.
            for relayed_outcome in (TierOutcome(alone=True), None):
                group_id = os.urandom(20)
                rep.board.open(group_id, members, holds=lambda who, signature: True)
                rep.board.post(group_id, outcome)
                relayer.board.relay(group_id, [member.id])
                relayer.board.post(group_id, relayed_outcome)
                got = await fetch(group_id, b"")
                assert got is not None and torch.equal(got.output, expected), relayed_outcome
            assert len(member.suspected) == 1, "a relayer that failed honestly is not suspected"
        finally:
            await shutdown(nodes)

    asyncio.run(scenario())
