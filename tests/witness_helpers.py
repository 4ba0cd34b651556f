"""Drive the coordinator's credit in-process: signed group entries of made-up rounds, and heartbeats that
report them straight into a real Store through the real HeartbeatBody and witnessed_rounds. Shared by
the credit and standing tests (tests/test_standing_redteam.py, tests/test_credit_redteam3.py)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

from coordinator.store import PeerRecord, Store
from coordinator.witness import witnessed_rounds
from protocols.envelope import seal
from protocols.keys import SigningKey
from protocols.messages import HeartbeatBody
from swarm.averaging.groups import GROUP_ENTRY

TARGET = 64.0  # the run's target batch (max_samples_per_step)
POISON = "e" * 64  # the state an attacker wants peers to load


def run(coro):
    return asyncio.run(coro)


def state(step: int) -> str:
    return f"{step:064x}"


def record(key: SigningKey, role: str = "data") -> PeerRecord:
    p = key.peer_id
    return PeerRecord(p, key.public_key.raw, p[:8], "cpu", role, "online", 0.0, 0.0, 0, 1, 1e12)


def a_round(keys: list[SigningKey], step: int, weight: float, *, run_id: str, now: float) -> list[bytes]:
    """Signed group entries of ``keys`` at ``step`` (what a member of a round reports as witness)."""
    body = lambda: {"schema_hash": b"s" * 32, "weight": weight, "commit": bytes(32),  # noqa: E731
                    "extra": {"step": step, "state_hash": "0" * 64}}  # fmt: skip
    return [seal(k, GROUP_ENTRY, run_id, body(), now=now) for k in keys]


class Beats:
    """Heartbeats straight into a real Store, ten coordinator seconds apart (so the verified step's rate
    never binds)."""

    def __init__(self, store: Store, run_id: str):
        self.store, self.run_id, self.seq, self.t = store, run_id, 0, 1.0
        self.now = time.time()

    async def beat(self, key: SigningKey, step: int, param_hash: str, rounds=None) -> None:
        self.seq += 1
        self.t += 10.0
        body = HeartbeatBody.model_validate(
            {"seq": self.seq, "state": "online", "step": step, "param_hash": param_hash,
             "rounds": list(rounds or [])}
        )  # fmt: skip
        kept, refused = witnessed_rounds(body.rounds, run_id=self.run_id, reporter=key.peer_id, now=self.now)
        assert not refused, refused
        await self.store.record_heartbeat(
            key.peer_id, seq=body.seq, seen_at=self.t, metrics={}, step=step, param_hash=param_hash,
            rounds=kept,
        )  # fmt: skip

    async def credit(self, key: SigningKey) -> float:
        return (await self.store.get_peer(key.peer_id)).contributed_samples

    def round(self, keys: list[SigningKey], step: int, weight: float) -> list[bytes]:
        return a_round(keys, step, weight, run_id=self.run_id, now=self.now)


@contextlib.contextmanager
def credit_store(tmp_path: Path, run_id: str, name: str = "c.db") -> Iterator[Beats]:
    store = Store.open_sync(
        tmp_path / name, run_id, max_samples_per_step=TARGET, max_verified_steps_per_s=1000
    )
    try:
        yield Beats(store, run_id)
    finally:
        store.close()


async def honest_step(b: Beats, honest: list[SigningKey], step: int, history: list) -> None:
    """The honest peers average in one group at ``step - 1`` (a quarter batch each) and heartbeat at
    ``step`` with their last 3 applied rounds, as the trainer does."""
    if step:
        history.append(a_round(honest, step - 1, TARGET / len(honest), run_id=b.run_id, now=b.now))
    for k in honest:
        await b.beat(k, step, state(step), history[-3:])
