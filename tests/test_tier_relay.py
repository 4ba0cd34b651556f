"""The second tier's hand-off down a tree of the group's members: who asks whom (``relay_order``,
``relay_parent``), and, over real libp2p peers, that a relayed outcome is the representative's, that the
representative still gets every member's attestation, and that a relayer that lies, fails or says ``alone``
costs its members only a question to the representative."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch
from hivemind.p2p import P2P
from test_tiers import MINE, NUMEL, PREFIX, SCHEMA, check_all, second_tier

from protocols import averaging_pb2 as apb
from protocols.keys import SigningKey
from swarm.averaging.allreduce import Traffic
from swarm.averaging.tiers import TierCheck, TierOutcome, relay_order, relay_parent, representative
from swarm.averaging.tierserve import TierBoard, TierServicer, fetch_down_the_tree


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


class _Node:
    """A real libp2p peer with a second-tier board and handler, admitting the group's members."""

    def __init__(self, p2p: P2P):
        self.p2p, self.board, self.traffic = p2p, TierBoard(), Traffic()
        self.id = p2p.peer_id.to_base58()

    async def serve(self, members: list[str]) -> None:
        async def admit(peer: str) -> str | None:
            return None if peer in members else f"{peer} is not a member"

        servicer = TierServicer(
            self.board, known=lambda group_id, asker: asker in members, wait_s=lambda: 20.0, admission=admit,
            traffic=self.traffic,
        )  # fmt: skip
        await servicer.add_p2p_handlers(self.p2p, namespace=PREFIX)


async def _three_peers() -> list[_Node]:
    first = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    maddrs = await first.get_visible_maddrs()
    rest = [await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=maddrs) for _ in range(2)]
    return [_Node(p) for p in (first, *rest)]


@pytest.mark.timeout(120)
def test_a_member_gets_the_representatives_outcome_through_its_relayer_and_around_one_that_lies():
    group_input = torch.randn(NUMEL)
    header, chunks, keys = second_tier(group_input=group_input)
    expected = check_all(header, chunks, group_input, keys)
    tier_rep = keys[header.representative].peer_id

    def check(first: apb.TierAnswer) -> TierCheck:
        return TierCheck(
            first, prefix=PREFIX, schema_hash=SCHEMA, numel=NUMEL, mine=MINE, representative=tier_rep,
            contribution=group_input, weight=64.0, max_age_s=60.0, certify=None, refusal=None,
        )  # fmt: skip

    async def scenario():
        rep, relayer, member = nodes = await _three_peers()
        try:
            members = [n.id for n in nodes]
            suspected: list[tuple[str, str]] = []

            async def fetch(group_id: bytes, attestation: bytes) -> TierCheck | None:
                return await fetch_down_the_tree(
                    member.p2p, PREFIX, apb.TierRequest(group_id=group_id, attestation=attestation),
                    representative=rep.p2p.peer_id, parent=relayer.p2p.peer_id, check=check, timeout_s=20.0,
                    chunk_timeout_s=5.0, traffic=member.traffic, suspect=lambda p, why: suspected.append((p, why)),
                )  # fmt: skip

            outcome = TierOutcome(
                alone=False, group_id=header.tier_group_id, entries=list(header.entries),
                representative=header.representative, signers=list(header.signers),
                chunks=[[c for c in chunks if c.part_index == part] for part in range(len(keys))],
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
            assert not suspected

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
            assert [p for p, _ in suspected] == [relayer.id] and "part 0 chunk 0" in suspected[0][1], (
                suspected
            )

            # A relayer that says alone, or has nothing: only the representative may say so; it is asked.
            for relayed_outcome in (TierOutcome(alone=True), None):
                group_id = os.urandom(20)
                rep.board.open(group_id, members, holds=lambda who, signature: True)
                rep.board.post(group_id, outcome)
                relayer.board.relay(group_id, [member.id])
                relayer.board.post(group_id, relayed_outcome)
                got = await fetch(group_id, b"")
                assert got is not None and torch.equal(got.output, expected), relayed_outcome
            assert len(suspected) == 1, "a relayer that failed honestly is not suspected"
        finally:
            for node in nodes:
                await node.p2p.shutdown()

    asyncio.run(scenario())
