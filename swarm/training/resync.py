"""How a data-parallel peer shares its state and catches up with the run: it serves its encoded state to
peers with a valid signed record, and moves to the state the run agrees on (the rule is in
``swarm.training.catchup``) by downloading it from a holder, or, in a swarm restarted from nothing, from
the coordinator's checkpoint.

:class:`CatchUp` is composed by :class:`swarm.training.peer.TrainingPeer`: it holds the peer's
``SyncedState``, reads its progress view, averager (libp2p daemon, bans, transfer deadlines) and the
groupmates of its applied rounds, and owns the stall clock of the catch-up rule. The trainer tells it when
a round was tried (``round_tried``) and gives two callbacks: ``before_load`` (drop a round in flight that
would land on the downloaded state) and ``after_load`` (start the accumulation again).

Example::

    catchup = CatchUp(synced, run, progress_view=view, averager=averager, dht=dht, peer_id=me,
                      groupmates=groupmates)
    if await catchup.catch_up():
        print("moved to", synced.step)
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import hivemind
from hivemind.p2p import PeerID

from protocols.keys import PublicKey
from swarm import journal
from swarm.averaging.averager import Averager
from swarm.config import RunConfig
from swarm.standing import Standing
from swarm.training.catchup import Groupmates, Position, catch_up_move, quorum
from swarm.training.progress import ProgressView
from swarm.training.sync import (
    NOT_SEEN_YET,
    download_state,
    fetch_checkpoint_record,
    from_any_holder,
    state_namespace,
)
from swarm.training.synced import SyncedState

logger = logging.getLogger(__name__)

# How long a peer of a coordinated run looks for the coordinator's checkpoint before training from step 0.
RESUME_LOOKUPS = 3
RESUME_LOOKUP_INTERVAL_S = 1.0


async def _nothing() -> None:
    return None


class CatchUp:
    """Serving this peer's state, and moving to the state the run holds (see the module docstring).

    Args:
        synced: the state this peer holds, which a download replaces.
        run: the run (its ID and ``training``'s catch-up settings).
        progress_view, averager, dht: the peer's verified view of the run, its averager and DHT node.
        peer_id: this peer's ID.
        groupmates: the members of its last applied rounds (the anchors of a stalled peer's catch-up).
        coordinator_key: the coordinator's key (None: a run without one, as in some tests).
        coordinator_checkpoint: whether the coordinator said it holds a checkpoint when this peer joined.
        standing: the coordinator's signed standing as the session last heard it: votes weigh by credit
            (None: a run without a coordinator; votes are counted only).
        before_load, after_load: called around a download's load (see the module docstring).
    """

    def __init__(
        self,
        synced: SyncedState,
        run: RunConfig,
        *,
        progress_view: ProgressView,
        averager: Averager,
        dht: hivemind.DHT,
        peer_id: str,
        groupmates: Groupmates,
        coordinator_key: PublicKey | None = None,
        coordinator_checkpoint: bool = True,
        standing: Standing | None = None,
        before_load: Callable[[], Awaitable[None]] = _nothing,
        after_load: Callable[[], None] = lambda: None,
    ):
        self.synced, self.config, self.progress_view, self.averager = synced, run, progress_view, averager
        self.dht, self.peer_id, self.groupmates = dht, peer_id, groupmates
        self.coordinator_key, self.coordinator_checkpoint = coordinator_key, coordinator_checkpoint
        self.before_load, self.after_load = before_load, after_load
        self.standing = standing
        # The most credit of this peer's own any standing it read held: a standing lists online peers
        # only, so the copy sent right after this peer was offline a while leaves it out, and its own
        # credit must still weigh against a state ahead (``catchup.by_credit``).
        self.own_credit = 0.0
        # When this peer first tried a round at its current step (None before it has): the catch-up
        # rule's stall clock, which time spent computing the batch must not start.
        self.stalled_since: float | None = None
        self.resyncs = 0
        self.next_record_check = 0.0

    def round_tried(self) -> None:
        """A round at this step was tried: the stall clock runs from the first one."""
        self.stalled_since = self.stalled_since or time.monotonic()

    def step_changed(self) -> None:
        self.stalled_since = None

    async def admit_download(self, requester: str) -> str | None:
        """State goes to the coordinator and to peers with a valid signed record in the last view."""
        run_id = self.config.run_id
        if self.coordinator_key is not None and requester == self.coordinator_key.peer_id:
            return None
        if requester in self.averager.banned:
            return f"{requester} is banned from run {run_id!r}"
        if requester not in self.progress_view.peers:
            return f"{requester} {NOT_SEEN_YET} in run {run_id!r}"
        return None

    async def resync(self, step: int, expected_hash: str, sources: list[str]) -> bool:
        """Download the state of ``step`` from one of ``sources`` that matches ``expected_hash``. A round in
        flight in the background is dropped first: it must not land on the downloaded state."""
        await self.before_load()
        synced, run_id = self.synced, self.config.run_id
        max_bytes = synced.max_bytes()

        async def fetch(holder: PeerID) -> tuple[PeerID, float, float]:  # holder, seconds, MiB
            started = time.monotonic()
            decoded = await download_state(
                self.averager.p2p, holder, namespace=state_namespace(run_id), run_id=run_id, min_step=step,
                expected_hash=expected_hash, max_bytes=max_bytes,
                timeout_s=self.averager.transfer_deadline_s(max_bytes), accept_newer=self._vouched_for,
            )  # fmt: skip
            fetched_s = time.monotonic() - started
            async with synced.lock:
                await synced.load(decoded)
                self.after_load()
                await synced.commit(decoded.step)
                self.step_changed()  # a new state, at another step or not: its rounds start afresh
            mib = sum(t.numel() * t.element_size() for t in decoded.tensors.values()) / 2**20
            return holder, fetched_s, mib

        loaded = await from_any_holder(sources, fetch, "state")
        if loaded is None:
            return False
        holder, fetched_s, mib = loaded
        self.resyncs += 1
        journal.record("download", synced.step, state_hash=synced.state_hash, mib=round(mib, 3))
        logger.info(
            f"loaded the state of step {synced.step} from {holder.to_base58()} (hash {synced.state_hash[:12]}; "
            f"{mib:.1f} MiB of tensors in {fetched_s:.1f}s)"
        )
        return True

    async def _vouched_for(self, step: int, state_hash: str) -> bool:
        """Whether the others' records vouch for a newer state a holder offered; the view may not have
        shown that step yet, so it waits for up to two more views."""
        interval_s = self.config.training.progress_interval_s
        view = self.progress_view
        for attempt in range(3):
            if attempt:  # the next view, or give up on it after a few intervals
                target, deadline = view.count + 1, time.monotonic() + 4 * interval_s + 1.0
                while view.count < target and time.monotonic() < deadline:
                    await asyncio.sleep(interval_s / 4)
            voters = [k for k in view.peers if k != self.peer_id]
            if view.positions.agreed(step, state_hash, voters, credit=self._credit(), me=self.peer_id):
                return True
        return False

    def ahead_or_apart(self) -> tuple[int, str, list[str]] | None:
        """The step and hash this peer should move to, with the peers that hold it; None if it is in line
        (the rule, and why a Sybil cannot steer it, is in ``swarm.training.catchup``)."""
        view = self.progress_view.peers
        others = {k: Position(v.step, v.state_hash) for k, v in view.items() if k != self.peer_id}
        mine = Position(self.synced.step, self.synced.state_hash)
        stuck_s = 0.0 if self.stalled_since is None else time.monotonic() - self.stalled_since
        trusted = self.groupmates.recent(self.synced.step)
        return catch_up_move(
            mine, others, self.config.training, stuck_s=stuck_s, trusted=trusted, credit=self._credit(),
            me=self.peer_id, before=self.groupmates.before(mine),
        )  # fmt: skip

    def _credit(self) -> dict[str, float] | None:
        """The standing's credit, this peer's own at the most any standing it read held."""
        if self.standing is None:
            return None
        credit = self.standing.credit
        self.own_credit = max(self.own_credit, credit.get(self.peer_id, 0.0))
        if self.own_credit <= credit.get(self.peer_id, 0.0):
            return credit
        return {**credit, self.peer_id: self.own_credit}

    async def _checkpoint_to_resume(self) -> tuple[int, str, list[str]] | None:
        """The coordinator's signed checkpoint, when no peer holds a later state (a restarted swarm)."""
        # Peers past step 0 make the checkpoint moot only when they are most of the view: one record of
        # step 1 must not make a restarted swarm train from scratch.
        # Nor before this peer has read the run's records twice: a joiner's first view can be empty while
        # the others train far past the checkpoint, which it would then load for nothing.
        others = [p for k, p in self.progress_view.peers.items() if k != self.peer_id]
        if (
            self.progress_view.count < 2
            or sum(p.step > 0 for p in others) >= quorum(max(len(others), 1))
            or time.monotonic() < self.next_record_check
        ):
            return None
        self.next_record_check = time.monotonic() + 2.0
        try:
            record = await fetch_checkpoint_record(self.dht, self.config.run_id, self.coordinator_key)
        except Exception as e:
            logger.debug(f"could not read the checkpoint record: {e!r}")
            return None
        if record is None or record[0] <= self.synced.step:
            return None
        step, expected = record
        logger.info(f"no peer is ahead; resuming from the coordinator's checkpoint of step {step}")
        return step, expected, [self.coordinator_key.peer_id]

    async def look_for_checkpoint(self, stop: asyncio.Event) -> None:
        """A swarm restarted from nothing resumes from the coordinator's checkpoint, but right after start-up
        the DHT may not find the record yet; once this peer has trained a step from scratch it never will.
        So a peer of a coordinated run looks a few times before it evaluates and trains from step 0: for
        the checkpoint while nobody is ahead, for a holder that serves it once peers are ahead (a holder
        refuses a requester whose first signed record it has not read yet). A peer whose coordinator held
        no checkpoint when it joined does not look: the main loop still catches up with peers ahead."""
        for _ in range(RESUME_LOOKUPS if self.coordinator_checkpoint else 0):
            if self.coordinator_key is None or self.synced.step > 0 or stop.is_set():
                return
            self.next_record_check = 0.0
            if await self.catch_up():
                return
            await asyncio.sleep(RESUME_LOOKUP_INTERVAL_S)

    async def catch_up(self) -> bool:
        """Move to the state the run holds when this peer is behind or apart; whether it moved."""
        move = self.ahead_or_apart()
        if move is None and self.synced.step == 0 and self.coordinator_key is not None:
            move = await self._checkpoint_to_resume()
        if move is None:
            return False
        step, expected, holders = move
        logger.info(
            f"the run holds step {step} (hash {expected[:12]}) and this peer step {self.synced.step}: "
            "resynchronizing"
        )
        return await self.resync(step, expected, holders)


__all__ = ["RESUME_LOOKUPS", "RESUME_LOOKUP_INTERVAL_S", "CatchUp"]
