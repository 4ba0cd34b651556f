"""Rehearsed attacks on verification, among real peers on loopback with a live coordinator judging.

Three peers average a vector the length of the run's model (so the coordinator's layout applies),
every part checked by a drawn validator (verify probability 1), accusations filed with the
coordinator as volunteers file them. Peer 2 is the attacker. Each test asserts who is banned and
that no honest peer ever is.

- ``draw_aware_reducer`` lies wherever it predicts no validator looks at the moment it signs. The draw
  comes from nonces revealed after delivery, hashed under a domain of their own: while the draw was
  the hash of the members' commitments (the nonces' plain SHA-256, public at matchmaking), it predicted
  every check and was never banned; now it guesses wrong, lies where it is checked and is banned. Each
  part holds two chunks, so the drawn one matters.
- ``framer`` (both tricks) files true evidence edited to accuse an honest reducer: the framer is banned.
- ``equivocator`` shows validators a contribution other than the one it sent (also, as a reducer, of
  its own input): it is banned, not the reducer that aggregated what it really sent.
- ``refusing_reducer`` lies and shows no input, to the validator nor to the coordinator that then
  demands them: it is banned.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import torch
from hivemind.p2p import PeerID
from hivemind.utils.multiaddr import Multiaddr

from coordinator.roundinputs import JOIN_MARGIN_S
from lab.localswarm import FAST_MEMBERSHIP, running_coordinator
from protocols.errors import SwarmError
from protocols.keys import PublicKey
from swarm.averaging.averager import Averager
from swarm.averaging.policy import PeerPolicy
from swarm.byzantine.attacks import make_attack
from swarm.config import RunConfig
from swarm.coordinator_client import CoordinatorClient
from swarm.models import build_model
from swarm.records import RecordSigner

pytestmark = pytest.mark.timeout(240)

RUN = "attack-run"
MODEL = {
    "name": "gpt",
    "config": {"d_model": 128, "n_layer": 1, "n_head": 2, "seq_len": 32},
}  # 2 chunks a part
MAX_ROUNDS = 6  # a validator draw that misses the attacker has probability 1/4 per round at most


def attack_run(run_id: str = RUN) -> RunConfig:
    return RunConfig(run_id=run_id, model=MODEL, membership=FAST_MEMBERSHIP)


@pytest.fixture
def run(request) -> RunConfig:
    """A run of its own for each test: the shared DHT nodes (``keyed_dhts``) keep every ban list published."""
    return attack_run(f"{RUN}-" + "".join(c if c.isalnum() else "-" for c in request.node.name)[-40:])


@pytest.fixture(scope="module")
def numel() -> int:
    run = attack_run()
    model = build_model(run.model.name, run.model.config, seed=run.training.seed)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


@pytest.fixture
def peers(keyed_dhts):
    return keyed_dhts


def rehearse(tmp_path, run, numel, peers, attack_name, options=None, *, until) -> tuple[dict, list, list]:
    """Rounds with peer 2 mounting ``attack_name`` until ``until(states)`` holds (or MAX_ROUNDS):
    (each peer's state at the coordinator, the accusations' answers, the averagers)."""
    attack = make_attack(attack_name, options, group_size=3, attackers=1)
    generator = torch.Generator().manual_seed(0)
    vectors = [torch.randn(numel, generator=generator) for _ in peers]

    async def scenario():
        async with (
            running_coordinator(run, tmp_path / "coordinator") as node,
            CoordinatorClient(node.address) as client,
        ):
            answers = []

            def accuser(key):
                async def accuse(accused, evidence, verdict):
                    answers.append(
                        await client.accuse(
                            key, run.run_id, accused=accused, reason=verdict, evidence=evidence.to_bytes()
                        )
                    )

                return accuse

            averagers = []
            judge = PublicKey.from_peer_id(node.coordinator_peer_id)
            for i, (dht, key) in enumerate(peers):
                admission = await client.join(key, run.run_id, name=f"peer{i}", device="cpu")
                # Volunteers bootstrap from the coordinator's DHT; these peers share their own, so the
                # coordinator's node dials them to ask for inputs.
                own = Multiaddr(f"/p2p/{key.peer_id}")
                addresses = [m.decapsulate(own) for m in dht.get_visible_maddrs()]
                await node.keeper.p2p._client.connect(PeerID.from_base58(key.peer_id), addresses)
                # As a volunteer's: entries carry the certificate, and the coordinator is the judge whom a
                # reducer shows the inputs it aggregated (before, it was refused like a stranger, so one
                # input a loaded machine failed to show a validator banned the reducer).
                policy = PeerPolicy(None, run.run_id, judge, allowed=ids(peers))
                signer = RecordSigner(key, admission.certificate.encoded)
                averager = Averager(
                    dht, prefix=run.run_id, numel=numel, aggregator="centered_clip", signing_key=key,
                    matchmaking_time_s=1.0, sender_timeout_s=2.0, data_plane=False, verify_probability=1.0,
                    accuse=accuser(key), hooks=attack if i == 2 else None, policy=policy,
                    record_signer=signer,
                )  # fmt: skip
                await averager.start()
                averagers.append(averager)

            async def heartbeats() -> None:  # as volunteers do: the coordinator asks only peers online
                while True:
                    for _, key in peers:
                        with contextlib.suppress(SwarmError):
                            await client.heartbeat(key, run.run_id, judge)
                    await asyncio.sleep(FAST_MEMBERSHIP.heartbeat_interval_s)

            beating = asyncio.create_task(heartbeats())
            # The coordinator convicts a reducer only for what it signed after its session joined
            # (coordinator.roundinputs.JOIN_MARGIN_S): a restarted peer lost what it held.
            await asyncio.sleep(JOIN_MARGIN_S + 1)
            states, full = {}, 0
            for _ in range(4 * MAX_ROUNDS):  # rounds a loaded machine forms short do not count
                outcomes = await asyncio.gather(
                    *[a.average(v, 1.0, expected_size=3) for a, v in zip(averagers, vectors, strict=True)]
                )
                for averager in averagers:
                    await averager.checks_done(60)
                if not all(o is not None and len(o[0].peer_ids) == 3 for o in outcomes):
                    continue  # on a loaded machine a leader may assemble before the third peer asks
                full += 1
                status = await client.status(run.run_id)
                states = {p.peer_id: p.state for p in status.peers}
                if until(states) or full == MAX_ROUNDS:
                    break
            assert full, "no round of all three peers formed"
            beating.cancel()
            for averager in averagers:
                await averager.shutdown()
            return states, answers, averagers

    return asyncio.run(scenario())


def ids(peers) -> list[str]:
    return [key.peer_id for _, key in peers]


def test_a_draw_aware_reducer_is_banned(tmp_path, run, numel, peers):
    honest, attacker = ids(peers)[:2], ids(peers)[2]
    states, answers, _ = rehearse(
        tmp_path, run, numel, peers, "draw_aware_reducer", until=lambda s: s.get(attacker) == "banned"
    )
    assert states[attacker] == "banned"
    assert any(a.banned_peer == attacker and "differs from the rule's result" in a.verdict for a in answers)
    assert all(states[p] != "banned" for p in honest), "no honest peer is ever banned"


@pytest.mark.parametrize("trick", ["numel", "slot"])
def test_a_framer_is_banned_and_the_reducer_it_accused_is_not(tmp_path, run, numel, peers, trick):
    honest, attacker = ids(peers)[:2], ids(peers)[2]
    states, answers, _ = rehearse(
        tmp_path, run, numel, peers, "framer", {"trick": trick}, until=lambda s: s.get(attacker) == "banned"
    )
    assert states[attacker] == "banned"
    assert any(a.banned_peer == attacker and "false accusation" in a.verdict for a in answers)
    assert all(states[p] != "banned" for p in honest), "no honest peer is ever banned"


def test_an_equivocator_is_banned_not_the_reducer(tmp_path, run, numel, peers):
    honest, attacker = ids(peers)[:2], ids(peers)[2]
    states, answers, _ = rehearse(
        tmp_path, run, numel, peers, "equivocator", until=lambda s: s.get(attacker) == "banned"
    )
    assert states[attacker] == "banned"
    proofs = ("two different contributions", "other than the one it aggregated")
    assert any(a.banned_peer == attacker and any(p in a.verdict for p in proofs) for a in answers)
    assert all(states[p] != "banned" for p in honest), "no honest peer is ever banned"


def test_a_reducer_that_shows_no_inputs_is_banned_when_it_will_not_show_the_coordinator(
    tmp_path, run, numel, peers
):
    honest, attacker = ids(peers)[:2], ids(peers)[2]
    states, answers, averagers = rehearse(
        tmp_path, run, numel, peers, "refusing_reducer", until=lambda s: s.get(attacker) == "banned"
    )
    # Its validator could collect neither its own input nor the others' from it: the coordinator asks
    # it for them and bans it when it does not show them.
    assert states[attacker] == "banned"
    assert any(a.banned_peer == attacker and "did not show the coordinator" in a.verdict for a in answers)
    assert all(states[p] != "banned" for p in honest), "no honest peer is ever banned"
    assert all(a.policy.refusal(p) is None for a in averagers[:2] for p in honest)
