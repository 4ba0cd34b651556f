"""Training progress shared through the DHT: who is at which step, with how many samples, holding what.

Every peer publishes a small signed record (``swarm.records``) under ``<run_id>.progress`` (subkey: its
peer ID) a few times a second and reads everyone else's. From these views a peer knows when the run has
accumulated the target batch for its step and, through ``swarm.training.catchup``, whether it must
resynchronize and from whom. Records expire unless refreshed, so departed peers drop out on their own.
Only records signed by a certified, unbanned peer under its own peer ID are in a view.
"""

from __future__ import annotations

from dataclasses import dataclass

import hivemind

from swarm.records import RecordSigner, RecordTrust, record_key


@dataclass(frozen=True)
class PeerProgress:
    """One peer's signed progress record as read from the DHT: where it is and how far its batch is."""

    peer_id: str
    step: int
    samples: int
    samples_per_s: float
    state_hash: str  # hash of the full training state at the start of ``step``
    updated_at: float  # when the peer signed the record


def progress_key(run_id: str) -> str:
    return record_key(run_id, "progress")


async def publish_progress(
    dht: hivemind.DHT, signer: RecordSigner, run_id: str, progress: PeerProgress, *, ttl_s: float
) -> bool:
    body = {
        "step": progress.step,
        "samples": progress.samples,
        "samples_per_s": float(progress.samples_per_s),
        "state_hash": progress.state_hash,
    }
    return await signer.publish(dht, "progress", run_id, body, ttl_s=ttl_s)


async def fetch_progress(dht: hivemind.DHT, trust: RecordTrust) -> dict[str, PeerProgress]:
    """The progress of every certified, unbanned peer with a valid record; anything else is logged once."""
    found = await dht.get(progress_key(trust.run_id), latest=True, return_future=True)
    return {
        peer_id: PeerProgress(
            peer_id, r.body.step, r.body.samples, r.body.samples_per_s, r.body.state_hash, r.issued_at
        )  # fmt: skip
        for peer_id, r in trust.open_dictionary("progress", found).items()
    }
