"""Rounds witnessed by their members: what the coordinator credits a data-parallel peer for.

Each heartbeat of a data-parallel peer carries the rounds it applied lately, each as the group entries
its kept members signed (its own among them; ``HeartbeatBody.rounds``). A member's entry is its signed
claim of the weight (samples) it brought to the round at its step, in an envelope bound to the run and
dated, which nobody else can forge. ``witnessed_rounds`` opens them and keeps the rounds that hold
together (every entry opens, one step, distinct signers, the reporter among them); the store then
credits each member other than the reporter (``coordinator.stepshares.credit_witnessed``): a peer is
credited for a round only when another member of it reports its entry, never for what it says of
itself. A freeloader that copies the public step and parameter hash joins no round and earns nothing.
What stays open: Sybils that sign entries for each other's made-up rounds are witnessed by each other
(each earns at most an equal share of a step, see ``coordinator.stepshares``), and the coordinator does not
recompute any round.

Example::

    rounds, refused = witnessed_rounds(body.rounds, run_id=run.run_id, reporter=envelope.sender, now=now)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pydantic import ValidationError

from protocols.envelope import open_envelope
from protocols.errors import SwarmError
from swarm.averaging.groups import GROUP_ENTRY, GroupEntryBody

# How old a witnessed entry may be: a peer resends its last few rounds with every heartbeat until the
# run's verified step passes them, and the step window (``stepshares.WITNESS_WINDOW_STEPS``) bounds replays.
WITNESS_MAX_AGE_S = 3600.0


@dataclass(frozen=True)
class WitnessedEntry:
    """One member's signed claim in a round: who, at which step, for how many samples."""

    peer_id: str
    step: int
    weight: float


def witnessed_rounds(
    rounds: Sequence[Sequence[bytes]], *, run_id: str, reporter: str, now: float
) -> tuple[list[list[WitnessedEntry]], list[str]]:
    """The rounds that hold together, and why each other one was left out (naming it)."""
    kept: list[list[WitnessedEntry]] = []
    refused: list[str] = []
    for i, entries in enumerate(rounds):
        try:
            kept.append(_open_round(entries, run_id=run_id, reporter=reporter, now=now, where=f"rounds[{i}]"))
        except SwarmError as e:
            refused.append(str(e))
    return kept, refused


def _open_round(
    entries: Sequence[bytes], *, run_id: str, reporter: str, now: float, where: str
) -> list[WitnessedEntry]:
    opened: list[WitnessedEntry] = []
    for j, data in enumerate(entries):
        what = f"{where}[{j}]"
        envelope = open_envelope(
            data, purpose=GROUP_ENTRY, run_id=run_id, max_age_s=WITNESS_MAX_AGE_S, now=now, what=what
        )
        try:
            body = GroupEntryBody.model_validate(envelope.body)
        except ValidationError as e:
            first = e.errors()[0]
            raise SwarmError(f"{what}: field {'.'.join(map(str, first['loc']))!r}: {first['msg']}") from None
        step = body.extra.get("step")
        if type(step) is not int or not 0 <= step < 2**63:
            raise SwarmError(f"{what}: its signed step {str(step)[:32]} is no step")
        opened.append(WitnessedEntry(envelope.sender, step, body.weight))
    signers = [e.peer_id for e in opened]
    if len(opened) < 2:
        raise SwarmError(f"{where}: a round of {len(opened)} member(s)")
    if len(set(signers)) != len(signers):
        raise SwarmError(f"{where} lists a member twice")
    if reporter not in signers:
        raise SwarmError(f"{where} is a round its reporter {reporter} was not a member of")
    if len({e.step for e in opened}) != 1:
        raise SwarmError(f"{where} holds entries of several steps")
    return opened


__all__ = ["WITNESS_MAX_AGE_S", "WitnessedEntry", "witnessed_rounds"]
