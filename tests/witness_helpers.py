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
from swarm.training.catchup import Position, catch_up_target

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


async def vm_ops(store: Store, call) -> int:
    """SQLite virtual-machine instructions the store's connection runs for ``await call()``: the CPU a read
    costs the store's one thread, counted deterministically (wall time on a busy machine is not)."""
    count = [0]

    def tick() -> int:
        count[0] += 1
        return 0

    await store._run(lambda db: db.set_progress_handler(tick, 10))
    try:
        await call()
    finally:
        await store._run(lambda db: db.set_progress_handler(None, 10))
    return count[0] * 10


def nobody_follows(standing: dict, honest: list[str], farm: list[str], last: int) -> None:
    """With ``honest`` at the honest state of ``last`` and ``farm`` at a made-up state one step ahead, a
    fresh peer, the checkpoint keeper and an honest peer in line all stay off the made-up state."""
    view = {
        **{k: Position(last, state(last)) for k in honest},
        **{k: Position(last + 1, POISON) for k in farm},
    }
    me = honest[0]
    for target in (
        catch_up_target(Position(0, "3" * 64), view, credit=standing),  # a fresh peer
        catch_up_target(None, view, credit=standing),  # the checkpoint keeper
        catch_up_target(Position(last, state(last)), {k: p for k, p in view.items() if k != me},
                        credit=standing, me=me),  # an honest peer in line
    ):  # fmt: skip
        assert target is None or target.state_hash != POISON, target


async def farm_run(b: Beats, n_honest: int, n_farm: int, steps: int) -> dict:
    """``n_honest`` honest members average at every step (TARGET / n_honest each, the whole batch between
    them); ``n_farm`` Sybil keys, present from the start, sign a made-up round of themselves at every step
    for the whole batch each, reported by two of them (so each is vouched), with heartbeats at step 0 and
    no hash (they never touch the verified step). Returns the keys, their IDs and credit, the standing."""
    store = b.store
    honest = [SigningKey.generate() for _ in range(n_honest)]
    farm = [SigningKey.generate() for _ in range(n_farm)]
    for k in (*honest, *farm):
        await store.admit(record(k))
    history: list = []
    for step in range(steps + 1):
        await honest_step(b, honest, step, history)
        if step and farm:
            made_up = b.round(farm, step - 1, TARGET)
            for i, k in enumerate(farm):
                await b.beat(k, 0, "", [made_up] if i < 2 else [])
    return {
        "honest": honest, "farm": farm, "honest_ids": [k.peer_id for k in honest],
        "farm_ids": [k.peer_id for k in farm], "honest_credit": [await b.credit(k) for k in honest],
        "farm_credit": [await b.credit(k) for k in farm], "standing": await store.standing(), "last": steps,
    }  # fmt: skip
