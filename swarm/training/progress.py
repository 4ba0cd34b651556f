"""Training progress shared through the DHT: who is at which step, with how many samples, holding what.

Every peer publishes a small signed record (``swarm.records``) under ``<run_id>.progress`` (subkey: its
peer ID) a few times a second and reads everyone else's. From these views a peer knows when the run has
accumulated the target batch for its step and, through ``swarm.training.catchup``, whether it must
resynchronize and from whom. Records expire unless refreshed, so departed peers drop out on their own.
Only records signed by a certified, unbanned peer under its own peer ID are in a view.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass

import hivemind

from swarm.averaging.groups import Misfit
from swarm.config import TrainingConfig
from swarm.records import RecordSigner, RecordTrust, record_key
from swarm.training.catchup import Position, PositionHistory

logger = logging.getLogger(__name__)
# The least time one progress exchange (publish, read, ban list) may take before it is given up and retried.
PROGRESS_EXCHANGE_MIN_TIMEOUT_S = 10.0


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


class ProgressView:
    """One peer's view of the run's progress, renewed by ``exchange``: the verified records of every peer
    (``peers``), the recent positions that the catch-up rule reads (``positions``), and how many views were
    fetched (``count``: a round waits for one taken at its own step).

    Args:
        dht, records, trust: where records are published, how this peer signs, whose records count.
        peer_id: this peer's ID (its own record is not a position of another).
        training: the run's training settings, read live (``progress_interval_s``, ``max_steps``).
        is_banned: whether a peer is banned now (its kept records are dropped).
    """

    def __init__(
        self,
        dht: hivemind.DHT,
        records: RecordSigner,
        trust: RecordTrust,
        peer_id: str,
        training: TrainingConfig,
        is_banned: Callable[[str], bool],
    ):
        self.dht, self.records, self.trust, self.peer_id = dht, records, trust, peer_id
        self.training, self.is_banned = training, is_banned
        self.peers: dict[str, PeerProgress] = {}
        self.positions = PositionHistory()  # recent steps' verified positions: a download the run outran
        self.count = 0

    async def exchange(self, own: PeerProgress | None) -> None:
        """Publish ``own`` signed (None: nothing, as a paused peer, which the others must not wait for) and
        read the verified records of every peer."""
        ttl_s = max(3.0, 6 * self.training.progress_interval_s)
        if own is not None:
            await publish_progress(self.dht, self.records, self.trust.run_id, own, ttl_s=ttl_s)
        fresh = await fetch_progress(self.dht, self.trust)
        # A failed read must not make the run look empty: keep records that have not expired yet.
        recent = {
            k: v for k, v in self.peers.items() if v.updated_at > time.time() - ttl_s and not self.is_banned(k)
        }  # fmt: skip
        self.peers = {**recent, **fresh}
        self.positions.observe(
            {k: Position(v.step, v.state_hash) for k, v in fresh.items() if k != self.peer_id},
            max_step=self.training.max_steps,
            keep=self.peers,
        )
        self.count += 1

    async def run(self, own: Callable[[], PeerProgress | None], after: Callable[[], Awaitable[None]]) -> None:
        """``exchange`` then ``after`` (the ban list) every ``progress_interval_s`` until cancelled. Each is
        bounded: a DHT call whose reply never comes (its coroutine dropped in the DHT's process) used to
        stop this loop for good, freezing the view, so a peer that fell behind never caught up."""

        async def once() -> None:
            await self.exchange(own())
            await after()

        while True:
            interval_s = self.training.progress_interval_s
            timeout_s = max(PROGRESS_EXCHANGE_MIN_TIMEOUT_S, 10 * interval_s)
            try:
                await asyncio.wait_for(once(), timeout=timeout_s)
            except asyncio.TimeoutError:
                logger.info(f"a progress exchange took over {timeout_s:.0f}s; trying again")
            except Exception as e:
                logger.debug(f"progress exchange failed: {e!r}")
            await asyncio.sleep(interval_s)


def step_misfit(
    theirs: dict, mine: dict, held: Collection[int] = (), *, state: bool = False
) -> Misfit | None:
    """Why a groupmate's signed round ``extra`` does not fit this peer's (``mine``); None if it fits.

    Only contributions of this step (in DiLoCo, this outer step): a gradient applied to another step's
    state would commit a state nobody holds, and a pseudo-gradient of another window would move the synced
    copy by a window's worth of stale progress. A member whose signed entry claims another step is
    excluded before the all-reduce (and suspected for a step ahead that no peer in ``held``, the steps
    of the run's signed progress records, holds, while the misfits are fewer than half of the group:
    ``VerifiedGroup.suspects``); the members at this step, who all see the same signed entries, exclude
    the same ones and average among themselves. A peer behind catches up by download. Before, in every_step,
    two Sybils claiming the next step in a group of four made the honest members skip the round, and a
    peer whose rounds fail for long enough lets the peers ahead decide its catch-up.
    """
    step = theirs.get("step")
    if type(step) is int and step == mine["step"]:  # not ``True``, which equals 1
        if state and theirs.get("state_hash") != mine.get("state_hash"):
            # ``state``: a run whose validators replay senders from the state of the round (sender
            # checks) takes only members at this peer's state; one apart from it, whichever side is
            # right, is excluded unblamed and the catch-up rule moves the minority.
            return Misfit(f"holds another state at step {step} than this peer's", blamed=False)
        return None
    # A step behind is what an honest laggard signs, and what a leader replaying the member's entry of an
    # earlier round shows: excluded, never blamed. So is a step ahead that the run's signed progress
    # records hold (``held``): this peer is the laggard, and a Sybil leader that lists honest peers' fresh
    # entries beside its own at this peer's step must not make it avoid them once it has caught up.
    backed = type(step) is int and (step < mine["step"] or step in held)
    return Misfit(f"claims step {str(step)[:32]}, not this round's {mine['step']}", blamed=not backed)
