"""The inputs a reducer signed it aggregated, kept after their round is gone for the coordinator's demand.

A round stays in the averager's registry only among its last ``KEEP_ROUNDS`` (its vectors are large). The
coordinator may demand the inputs behind an aggregate for ``INPUT_DEMAND_WINDOW_S`` after it was signed,
by its own clock, and members accept a signed time up to ``MAX_CLOCK_SKEW_S`` off theirs
(``swarm.averaging.evidence``); so once a round's reveal phase is over, this peer copies out the signed
inputs of each chunk it aggregated (its own part, and parts it re-reduced as a substitute) and keeps them
``KEEP_INPUTS_S``, within ``MAX_KEPT_INPUT_BYTES``. A round whose draw is known keeps only its drawn
chunk, the only one a demand may name; one whose draw never completed here keeps every chunk, if it fits.

Example::

    archive = InputArchive()
    archive.keep(runner)                       # after the round's reveal phase
    kept = archive.lookup(group_id, part, chunk, sender_index)   # (members, a SignedInput or None), or None
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass

from protocols.envelope import MAX_CLOCK_SKEW_S
from swarm.averaging.evidence import INPUT_DEMAND_WINDOW_S, SignedInput

logger = logging.getLogger(__name__)

KEEP_INPUTS_S = INPUT_DEMAND_WINDOW_S + 2 * MAX_CLOCK_SKEW_S + 60.0  # 900 s
MAX_KEPT_INPUT_BYTES = 256 << 20
MAX_KEPT_ROUNDS = 4096


@dataclass
class _Kept:
    members: tuple[str, ...]
    inputs: dict[tuple[int, int, int], SignedInput]  # (part, chunk, sender index) -> its signed input
    nbytes: int
    at: float


class InputArchive:
    """Signed inputs of the chunks this peer aggregated, by round; the oldest go first past the bounds."""

    def __init__(self, keep_s: float = KEEP_INPUTS_S, max_bytes: int = MAX_KEPT_INPUT_BYTES):
        self.keep_s, self.max_bytes = keep_s, max_bytes
        self.rounds: OrderedDict[bytes, _Kept] = OrderedDict()
        self.nbytes = 0

    def keep(self, runner) -> None:
        """Copy out what ``runner`` (a ``ButterflyAllReduce`` whose reveal phase is over) aggregated."""
        held = runner.aggregated_inputs()
        inputs = {(part, chunk, i.sender_index): i for (part, chunk), items in held.items() for i in items}
        if not inputs:
            return
        nbytes = sum(len(i.data) + len(i.signature) for i in inputs.values())
        if nbytes > self.max_bytes:
            logger.warning(
                f"the inputs this peer aggregated in round {runner.group_id.hex()[:8]} ({nbytes >> 20} MiB, "
                "its draw incomplete) exceed what it keeps for the coordinator's demand"
            )
            return
        self._expire(time.monotonic())
        while self.rounds and (self.nbytes + nbytes > self.max_bytes or len(self.rounds) >= MAX_KEPT_ROUNDS):
            self._drop(next(iter(self.rounds)))
        self.rounds[runner.group_id] = _Kept(tuple(runner.members), inputs, nbytes, time.monotonic())
        self.nbytes += nbytes

    def lookup(
        self, group_id: bytes, part: int, chunk: int, sender_index: int
    ) -> tuple[tuple[str, ...], SignedInput | None] | None:
        """(the round's members, the input kept for that slot or None); None for a round not kept here."""
        self._expire(time.monotonic())
        kept = self.rounds.get(group_id)
        if kept is None:
            return None
        return kept.members, kept.inputs.get((part, chunk, sender_index))

    def _expire(self, now: float) -> None:
        while self.rounds and now - next(iter(self.rounds.values())).at > self.keep_s:
            self._drop(next(iter(self.rounds)))

    def _drop(self, group_id: bytes) -> None:
        self.nbytes -= self.rounds.pop(group_id).nbytes


__all__ = ["KEEP_INPUTS_S", "MAX_KEPT_INPUT_BYTES", "InputArchive"]
