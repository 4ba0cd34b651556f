"""Real libp2p peers serving the second tier's hand-off in-process, and a signed hand-off to pass among them:
what ``tests/test_tier_relay.py`` and ``tests/test_relay_redteam.py`` share."""

from __future__ import annotations

import contextlib

import torch
from hivemind.p2p import P2P
from test_tiers import MINE, NUMEL, PREFIX, SCHEMA, check_all, second_tier

from protocols import averaging_pb2 as apb
from swarm.averaging.allreduce import Traffic
from swarm.averaging.tiers import TierCheck, TierOutcome
from swarm.averaging.tierserve import TierBoard, TierServicer


class Node:
    """A real libp2p peer with a second-tier board, its traffic, and who it suspected."""

    def __init__(self, p2p: P2P):
        self.p2p, self.board, self.traffic = p2p, TierBoard(), Traffic()
        self.id = p2p.peer_id.to_base58()
        self.suspected: list[tuple[str, str]] = []

    def suspect(self, peer: str, why: str) -> None:
        self.suspected.append((peer, why))

    async def serve(self, members: list[str], *, wait_s: float = 20.0) -> None:
        """Serve the second tier to ``members`` (admitted, and members of every group here)."""

        async def admit(peer: str) -> str | None:
            return None if peer in members else f"{peer} is not a member"

        servicer = TierServicer(
            self.board, known=lambda group_id, asker: asker in members, wait_s=lambda: wait_s, admission=admit,
            traffic=self.traffic,
        )  # fmt: skip
        await servicer.add_p2p_handlers(self.p2p, namespace=PREFIX)


async def peers(n: int) -> list[Node]:
    """``n`` peers on 127.0.0.1, each connected to every other: a peer that knew only the first one's address
    could fail to reach another at once on a loaded machine (no route found yet), which reads as a refusal."""
    made: list[P2P] = []
    maddrs: list = []
    for _ in range(n):
        p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=list(maddrs))
        maddrs.extend(await p2p.get_visible_maddrs())
        made.append(p2p)
    return [Node(p) for p in made]


async def serving(n: int) -> tuple[list[Node], list[str]]:
    """``n`` peers, each serving the second tier to all of them; and their IDs."""
    nodes = await peers(n)
    members = [node.id for node in nodes]
    for node in nodes:
        await node.serve(members)
    return nodes, members


async def shutdown(nodes: list[Node]) -> None:
    for node in nodes:
        with contextlib.suppress(Exception):
            await node.p2p.shutdown()


def handoff():
    """A second tier's signed hand-off, fresh now: (outcome, expected output, check factory by max age)."""
    group_input = torch.randn(NUMEL)
    header, chunks, keys = second_tier(group_input=group_input)
    expected = check_all(header, chunks, group_input, keys)
    tier_rep = keys[header.representative].peer_id
    outcome = TierOutcome(
        alone=False, group_id=header.tier_group_id, entries=list(header.entries),
        representative=header.representative, signers=list(header.signers),
        chunks=[[c for c in chunks if c.part_index == part] for part in range(len(keys))],
    )  # fmt: skip

    def check(max_age_s: float):
        def build(first: apb.TierAnswer) -> TierCheck:
            return TierCheck(
                first, prefix=PREFIX, schema_hash=SCHEMA, numel=NUMEL, mine=MINE, representative=tier_rep,
                contribution=group_input, weight=64.0, max_age_s=max_age_s, certify=None, refusal=None,
            )  # fmt: skip

        return build

    return outcome, expected, check
