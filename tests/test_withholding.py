"""A withholder (honest contributions, but never its own part back) cannot halt training.

Before, a member that never returned its part made every round it joined incomplete, and nothing
remembered it, so it joined every retry. Now each peer that waited in vain for a reducer avoids it in
matchmaking for a while (``PeerPolicy.suspect``): the retry forms without it and completes.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from swarm.averaging.averager import Averager
from swarm.byzantine.attacks import make_attack
from swarm.dht import SpawnedDHT
from swarm.identity import create_identity

pytestmark = pytest.mark.timeout(180)

NUMEL = 30_011
TRIES = 3


@pytest.fixture
def peers(tmp_path):
    keys = [create_identity(tmp_path / f"peer{i}.key") for i in range(3)]

    def start(i: int, initial_peers) -> SpawnedDHT:
        return SpawnedDHT(
            start=True, initial_peers=initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
            identity_path=str(tmp_path / f"peer{i}.key"), check_if_identity_free=False,
        )  # fmt: skip

    first = start(0, [])
    nodes = [first, start(1, first.get_visible_maddrs()), start(2, first.get_visible_maddrs())]
    yield list(zip(nodes, keys, strict=True))
    for node in nodes:
        node.shutdown()


def test_rounds_complete_without_a_withholder(peers):
    withholder = make_attack("withholder", group_size=3, attackers=1)
    generator = torch.Generator().manual_seed(0)
    vectors = [torch.randn(NUMEL, generator=generator) for _ in peers]
    culprit = peers[2][1].peer_id

    async def scenario():
        averagers = [
            Averager(
                dht,
                prefix="withholding",
                numel=NUMEL,
                signing_key=key,
                matchmaking_time_s=1.0,
                sender_timeout_s=1.0,
                data_plane=False,
                attack=withholder if i == 2 else None,
            )  # fmt: skip
            for i, (dht, key) in enumerate(peers)
        ]
        for averager in averagers:
            await averager.start()
        rounds = []
        for _ in range(1 + TRIES):
            outcomes = await asyncio.gather(
                *[a.average(v, 1.0, expected_size=3) for a, v in zip(averagers, vectors, strict=True)]
            )
            rounds.append(outcomes)
            honest = outcomes[:2]
            if all(o is not None and o[1].complete for o in honest):
                break
        for averager in averagers:
            await averager.shutdown()
        return rounds, averagers

    rounds, averagers = asyncio.run(scenario())
    first = rounds[0]
    assert all(o is not None and not o[1].complete for o in first[:2]), "the withholder spoils its round"
    assert all(culprit in o[1].failed_reducers for o in first[:2])
    assert all(a.policy.refusal(culprit) is not None for a in averagers[:2])
    last = rounds[-1][:2]
    assert len(rounds) <= 1 + TRIES and all(o is not None and o[1].complete for o in last), (
        "a retry completes among the honest peers"
    )
    assert all(culprit not in [p.to_base58() for p in group.peer_ids] for group, _ in last)
    assert torch.equal(last[0][1].vector, last[1][1].vector)
    assert torch.allclose(last[0][1].vector, (vectors[0] + vectors[1]) / 2, atol=2e-3)
