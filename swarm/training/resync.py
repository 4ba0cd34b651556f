"""How a data-parallel peer shares its state and catches up with the run: it serves its encoded state to
peers with a valid signed record, and moves to the state the run agrees on (the rule is in
``swarm.training.catchup``) by downloading it from a holder, or, in a swarm restarted from nothing, from
the coordinator's checkpoint.

:class:`CatchUp` is a part of :class:`swarm.training.trainer.Trainer`, kept in its own module: it uses
the trainer's synced model and optimizer, view, position history, averager (its libp2p daemon and bans),
DHT, state lock and ``_commit``.
"""

from __future__ import annotations

import asyncio
import logging
import time

from hivemind.p2p import PeerID

from swarm.training.catchup import Position, catch_up_move, quorum
from swarm.training.state import encode_state, load_state_tensors, state_tensors
from swarm.training.sync import (
    NOT_SEEN_YET,
    EncodedState,
    download_limit,
    download_state,
    fetch_checkpoint_record,
    from_any_holder,
    state_namespace,
)

logger = logging.getLogger(__name__)

# How long a peer of a coordinated run looks for the coordinator's checkpoint before training from step 0.
RESUME_LOOKUPS = 3
RESUME_LOOKUP_INTERVAL_S = 1.0


class CatchUp:
    """Serving this peer's state, and moving to the state the run holds (see the module docstring)."""

    async def encoded_state(self) -> EncodedState | None:
        async with self._state_lock:
            if self._encoded is None or self._encoded.step != self.step:
                tensors = state_tensors(self.synced_model, self.synced_optimizer)
                data = await asyncio.to_thread(
                    encode_state, self.step, tensors, {"run_id": self.config.run_id}
                )
                self._encoded = EncodedState(self.step, self.state_hash, data)
            return self._encoded

    async def _admit_download(self, requester: str) -> str | None:
        """State goes to the coordinator and to peers with a valid signed record in the last view."""
        if self.coordinator_key is not None and requester == self.coordinator_key.peer_id:
            return None
        if requester in self.averager.banned:
            return f"{requester} is banned from run {self.config.run_id!r}"
        if requester not in self.view:
            return f"{requester} {NOT_SEEN_YET} in run {self.config.run_id!r}"
        return None

    def max_state_bytes(self) -> int:
        tensors = state_tensors(self.synced_model, self.synced_optimizer)
        return download_limit(sum(t.numel() * t.element_size() for t in tensors.values()))

    async def resync(self, step: int, expected_hash: str, sources: list[str]) -> bool:
        """Download the state of ``step`` from one of ``sources`` that matches ``expected_hash``. A round in
        flight in the background is dropped first: it must not land on the downloaded state."""
        await self.strategy.drop_pending()
        max_bytes = self.max_state_bytes()

        async def fetch(holder: PeerID) -> tuple[PeerID, float, float]:  # holder, seconds, MiB
            started = time.monotonic()
            decoded = await download_state(
                self.averager.p2p, holder, namespace=state_namespace(self.config.run_id),
                run_id=self.config.run_id, min_step=step, expected_hash=expected_hash,
                max_bytes=max_bytes, timeout_s=self.averager.transfer_deadline_s(max_bytes),
                accept_newer=self._vouched_for,
            )  # fmt: skip
            fetched_s = time.monotonic() - started
            async with self._state_lock:
                await asyncio.to_thread(
                    load_state_tensors, self.synced_model, self.synced_optimizer, decoded.tensors
                )
                self._reset_accumulation()
                await self._commit(decoded.step)
            self._step_view = self.progress_view.count
            mib = sum(t.numel() * t.element_size() for t in decoded.tensors.values()) / 2**20
            return holder, fetched_s, mib

        loaded = await from_any_holder(sources, fetch, "state")
        if loaded is None:
            return False
        holder, fetched_s, mib = loaded
        self._stats["resyncs"] += 1
        logger.info(
            f"loaded the state of step {self.step} from {holder.to_base58()} (hash {self.state_hash[:12]}; "
            f"{mib:.1f} MiB of tensors in {fetched_s:.1f}s)"
        )
        return True

    async def _vouched_for(self, step: int, state_hash: str) -> bool:
        """Whether the others' records vouch for a newer state a holder offered; the view may not have
        shown that step yet, so it waits for up to two more views."""
        interval_s = self.config.training.progress_interval_s
        for attempt in range(3):
            if attempt:  # the next view, or give up on it after a few intervals
                target, deadline = self.progress_view.count + 1, time.monotonic() + 4 * interval_s + 1.0
                while self.progress_view.count < target and time.monotonic() < deadline:
                    await asyncio.sleep(interval_s / 4)
            if self.progress_view.positions.agreed(
                step, state_hash, [k for k in self.view if k != self.peer_id]
            ):
                return True
        return False

    def _ahead_or_apart(self) -> tuple[int, str, list[str]] | None:
        """The step and hash this peer should move to, with the peers that hold it; None if it is in line
        (the rule, and why a Sybil cannot steer it, is in ``swarm.training.catchup``)."""
        others = {k: Position(v.step, v.state_hash) for k, v in self.view.items() if k != self.peer_id}
        mine = Position(self.step, self.state_hash)
        stuck_s = 0.0 if self._rounds_since is None else time.monotonic() - self._rounds_since
        trusted = self.groupmates.recent(self.step)
        return catch_up_move(mine, others, self.config.training, stuck_s=stuck_s, trusted=trusted)

    async def _checkpoint_to_resume(self) -> tuple[int, str, list[str]] | None:
        """The coordinator's signed checkpoint, when no peer holds a later state (a restarted swarm)."""
        # Peers past step 0 make the checkpoint moot only when they are most of the view: one record of
        # step 1 must not make a restarted swarm train from scratch.
        others = [p for k, p in self.view.items() if k != self.peer_id]
        if (
            sum(p.step > 0 for p in others) >= quorum(max(len(others), 1))
            or time.monotonic() < self._next_record_check
        ):
            return None
        self._next_record_check = time.monotonic() + 2.0
        try:
            record = await fetch_checkpoint_record(self.dht, self.config.run_id, self.coordinator_key)
        except Exception as e:
            logger.debug(f"could not read the checkpoint record: {e!r}")
            return None
        if record is None or record[0] <= self.step:
            return None
        step, expected = record
        logger.info(f"no peer is ahead; resuming from the coordinator's checkpoint of step {step}")
        return step, expected, [self.coordinator_key.peer_id]

    async def _look_for_checkpoint(self, stop: asyncio.Event) -> None:
        """A swarm restarted from nothing resumes from the coordinator's checkpoint, but right after start-up
        the DHT may not find the record yet; once this peer has trained a step from scratch it never will.
        So a peer of a coordinated run looks a few times before it evaluates and trains from step 0: for
        the checkpoint while nobody is ahead, for a holder that serves it once peers are ahead (a holder
        refuses a requester whose first signed record it has not read yet). A peer whose coordinator held
        no checkpoint when it joined does not look: the main loop still catches up with peers ahead."""
        for _ in range(RESUME_LOOKUPS if self.coordinator_checkpoint else 0):
            if self.coordinator_key is None or self.step > 0 or stop.is_set():
                return
            self._next_record_check = 0.0
            if await self._catch_up():
                return
            await asyncio.sleep(RESUME_LOOKUP_INTERVAL_S)

    async def _catch_up(self) -> bool:
        move = self._ahead_or_apart()
        if move is None and self.step == 0 and self.coordinator_key is not None:
            move = await self._checkpoint_to_resume()
        if move is None:
            return False
        step, expected, holders = move
        logger.info(
            f"the run holds step {step} (hash {expected[:12]}) and this peer step {self.step}: resynchronizing"
        )
        return await self.resync(step, expected, holders)
