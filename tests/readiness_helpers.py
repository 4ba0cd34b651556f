"""What the readiness tests share: a real every_step peer, signed claims at its step, second-tier group
certificates, and the first point at which a peer with a round behind it counts the target batch
(``swarm.training.readiness``)."""

from __future__ import annotations

import time

import torch
from helpers import KEYS

from lab.localswarm import tiny_run
from protocols.keys import SigningKey
from swarm.averaging.tiercert import certificate, certificate_misfit, result_digest, sign_attestation
from swarm.training.progress import PeerProgress
from swarm.training.readiness import ShownWork, counted_claims
from swarm.training.trainer import Trainer

TARGET, MICRO = 256, 4
STATE = "ab" * 32
DIGEST = result_digest(torch.zeros(4))


def readiness_trainer(nodes, name: str) -> Trainer:
    """A real every_step peer on the first DHT node, at a target of ``TARGET`` in micro-batches of ``MICRO``."""
    torch.set_num_threads(1)
    run = tiny_run(name, target_batch_size=TARGET, micro_batch_size=MICRO)
    dht = nodes[0]
    me = dht.peer_id.to_base58()
    return Trainer(run, dht, peer_id=me, signing_key=KEYS[me])


def at_step(peer, claims: dict[str, int]) -> None:
    """Signed records of ``claims`` (peer -> samples) at the peer's step, in a view read after it began."""
    now = time.time()
    peer.progress_view.peers = {
        p: PeerProgress(p, peer.step, n, 1.0, peer.state_hash, now) for p, n in claims.items()
    }
    peer.progress_view.count = peer._step_view + 1


def keys(count: int) -> list[SigningKey]:
    return [SigningKey.generate() for _ in range(count)]


def signed_group(group_id: bytes, keys: list[SigningKey], weight: float, *, step: int = 0) -> dict:
    """A second-tier group certificate every listed member signed, checked as a second tier checks it."""
    members = [k.peer_id for k in keys]
    rep = members[0]
    signed = {
        i: sign_attestation(k, group_id, step, STATE, rep, weight, DIGEST, members)
        for i, k in enumerate(keys)
    }
    group = certificate(group_id, members, weight, DIGEST, signed)
    assert certificate_misfit({"group": group}, signer=rep, step=step, state_hash=STATE, refusal=None) is None
    return group


def plain_group(group_id: bytes, members: list[str], weight: float) -> dict:
    """A certificate every member signed (its signatures checked before it reaches a ``ShownWork``)."""
    return certificate(group_id, members, float(weight), b"\0" * 32, dict.fromkeys(range(len(members)), b"s"))


def first_ready(shown: ShownWork, claims_at, *, target: int, micro: int, most: int = 100_000) -> int:
    """The fewest own samples (in ``micro`` steps) at which a peer with ``shown`` behind it counts the
    target, the others' claims at each point being ``claims_at(own)``."""
    own = 0
    while own < most:
        own += micro
        if own + sum(counted_claims(claims_at(own), own=own, shown=shown, step=shown.step)) >= target:
            return own
    raise AssertionError("never ready")
