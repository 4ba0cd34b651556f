"""Training progress shared through the DHT: who is at which step, with how many samples, holding what.

Every peer publishes a small record under ``<run_id>.progress`` (subkey: its peer ID) a few times a
second and reads everyone else's. From these views a peer knows when the run has accumulated the target
batch for its step, whether others moved ahead (so it must resynchronize), and which state hash the
peers at a step agree on. Records expire unless refreshed, so departed peers drop out on their own.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from dataclasses import asdict, dataclass

import hivemind
from hivemind.utils import get_dht_time

logger = logging.getLogger(__name__)

HASH_CHARS = 64


@dataclass(frozen=True)
class PeerProgress:
    peer_id: str
    step: int
    samples: int
    samples_per_s: float
    state_hash: str  # hash of the full training state at the start of ``step``
    updated_at: float

    @classmethod
    def parse(cls, peer_id: str, value: object) -> PeerProgress | None:
        """A record from the DHT, or None (with a log line naming the peer) when it is malformed."""
        try:
            if not isinstance(value, dict):
                raise TypeError("not a map")
            record = cls(
                peer_id=peer_id,
                step=value["step"],
                samples=value["samples"],
                samples_per_s=float(value["samples_per_s"]),
                state_hash=value["state_hash"],
                updated_at=float(value["updated_at"]),
            )
            if not (isinstance(record.step, int) and record.step >= 0 and isinstance(record.samples, int)):
                raise ValueError("step and samples must be non-negative integers")
            if record.samples < 0 or not math.isfinite(record.samples_per_s) or record.samples_per_s < 0:
                raise ValueError("samples and samples_per_s must be non-negative")
            if not isinstance(record.state_hash, str) or len(record.state_hash) != HASH_CHARS:
                raise ValueError("state_hash must be 64 hex characters")
        except (KeyError, TypeError, ValueError) as e:
            logger.debug(f"ignoring progress record of {peer_id[:64]!r}: {e}")
            return None
        return record


def progress_key(run_id: str) -> str:
    return f"{run_id}.progress"


async def publish_progress(dht: hivemind.DHT, run_id: str, progress: PeerProgress, *, ttl_s: float) -> bool:
    record = asdict(progress)
    record.pop("peer_id")
    return bool(
        await dht.store(
            progress_key(run_id), record, expiration_time=get_dht_time() + ttl_s, subkey=progress.peer_id,
            return_future=True,
        )
    )  # fmt: skip


async def fetch_progress(dht: hivemind.DHT, run_id: str) -> dict[str, PeerProgress]:
    found = await dht.get(progress_key(run_id), latest=True, return_future=True)
    if found is None or not isinstance(found.value, dict):
        return {}
    view = {}
    for subkey, item in found.value.items():
        if isinstance(subkey, str):
            record = PeerProgress.parse(subkey, item.value)
            if record is not None:
                view[subkey] = record
    return view


def agreed_hash(view: dict[str, PeerProgress], step: int) -> tuple[str, int] | None:
    """The state hash most peers at ``step`` report (ties: the smallest hash) and how many report it."""
    counts = Counter(p.state_hash for p in view.values() if p.step == step)
    if not counts:
        return None
    return min(counts.items(), key=lambda item: (-item[1], item[0]))
