"""The one catch-up rule: when a holder of training state must move to another state, and from whom.

Used by the data-parallel trainer, by every pipeline stage replica (among the replicas of its stage)
and by the coordinator's checkpoint keeper, so all three follow exactly the same rule:

1. Only positions (step, state hash) from signed records of distinct certified, unbanned peers seen in
   the last record window count (``swarm.records.RecordTrust`` builds those views; a made-up subkey, an
   unsigned record or a banned signer never reaches this module).
2. A position is followed only when a strict majority of the voters hold it. The voters are the other
   peers at, ahead of, or one step behind the caller's step, plus the caller itself when it sees at
   least two other peers and no voter but the candidate's holders is ahead of it (its state is then
   as current as any). Peers one step behind vote because right after a commit the caller's honest
   groupmates still show the step they are finishing: were they left out, one admitted peer announcing
   a step ahead would be a majority of one; the caller's own vote covers a caller whose groupmates are
   further behind. Peers further behind will follow too and get no vote otherwise. A
   handful of Sybil keys therefore move nobody: with fewer certified attackers than honest peers they
   never outnumber the honest voters, and admission bounds how many keys one attacker gets. A
   coordinator's signed checkpoint record is the other trusted source; callers use it when no peer has
   trained past step 0.
   A caller that has been stuck at its step for longer than a whole round can take (``stalled``) lets
   only the peers ahead of it vote: the peers at its own step may be as stuck as it is (a groupmate
   that keeps vanishing), and one completed round must not leave them apart for good. An attacker
   must then both stall every honest round and outvote the honest peers ahead, for that long.
3. Never backwards, never past ``max_step`` (the run's ``max_steps``, or ``MAX_STEP``): a record of step
   2**63-1 cannot freeze a run or its checkpoints.
4. At the caller's own step the majority position must also beat the caller's own side (itself plus
   the peers that agree with it); equal sides go to the smaller hash, so two apart peers never swap.
5. The state is downloaded only from the peers that hold the chosen position (certified holders), and
   each download is verified against the hash (``swarm.training.sync``). A holder that trained past
   that step before the download began offers its newer state; it is taken only when rule 2 holds for
   it among the records seen at that step (``PositionHistory``), otherwise the caller looks again.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

MAX_STEP = 2**62


@dataclass(frozen=True)
class Position:
    step: int
    state_hash: str


@dataclass(frozen=True)
class Target:
    """Where to move: the position, the peers that hold it, and how many of the others vouch for it."""

    step: int
    state_hash: str
    holders: list[str]
    support: int


def quorum(others: int) -> int:
    """Agreeing peers needed among ``others`` certified peers: a strict majority."""
    return others // 2 + 1


def catch_up_target(
    mine: Position | None,
    others: Mapping[str, Position],
    *,
    max_step: int | None = None,
    stalled: bool = False,
) -> Target | None:
    """The position to move to, or None when the caller is in line (or no majority exists yet).

    ``others`` maps peer IDs (never the caller's own) to their verified positions; ``mine`` is None for a
    caller that holds no state of its own (the checkpoint keeper)."""
    limit = min(MAX_STEP, max_step if max_step is not None else MAX_STEP)
    own_vote = 0
    if mine is None:
        lowest, voters = -1, list(others.values())
    elif stalled:
        lowest = mine.step + 1
        voters = [p for p in others.values() if p.step >= lowest]
    else:
        lowest = mine.step
        voters = [p for p in others.values() if p.step >= mine.step - 1]
    counts = Counter(Position(p.step, p.state_hash) for p in voters if lowest <= p.step <= limit)
    if not counts:
        return None
    best, support = min(counts.items(), key=lambda item: (-item[1], -item[0].step, item[0].state_hash))
    if mine is not None and not stalled and len(others) >= 2:
        # The caller's own state is a vote when no voter but the candidate's holders is ahead of it.
        own_vote = int(all(p.step <= mine.step for p in voters if Position(p.step, p.state_hash) != best))
    if support < quorum(len(voters) + own_vote) or best == mine:
        return None
    if mine is not None and best.step == mine.step:
        mine_side = 1 + sum(1 for p in voters if Position(p.step, p.state_hash) == mine)
        if mine_side > support or (mine_side == support and mine.state_hash < best.state_hash):
            return None
    holders = sorted(peer for peer, p in others.items() if Position(p.step, p.state_hash) == best)
    return Target(best.step, best.state_hash, holders, support)


class PositionHistory:
    """The positions seen in verified records over the last ``max_steps`` steps, for a download that the
    run outran: a holder that trained on while a requester read a slightly older view offers a newer
    state, and rule 2 is applied to it with the records seen at that step as support. The state is
    taken only when a strict majority of the voters (every other certified peer in the current view: the
    caller is behind them, so its own state has no vote) were seen at that step with that hash; a
    holder alone among many cannot vouch for its own state, however few records of that step the
    caller happened to see.
    """

    def __init__(self, max_steps: int = 64):
        self.max_steps = max_steps
        self._by_step: dict[int, dict[str, str]] = {}

    def observe(self, others: Mapping[str, Position], *, max_step: int | None = None) -> None:
        limit = min(MAX_STEP, max_step if max_step is not None else MAX_STEP)
        for peer, position in others.items():
            if 0 <= position.step <= limit:
                self._by_step.setdefault(position.step, {})[peer] = position.state_hash
        for step in sorted(self._by_step)[: max(0, len(self._by_step) - self.max_steps)]:
            del self._by_step[step]

    def agreed(self, step: int, state_hash: str, voters: int) -> bool:
        """Whether a strict majority of ``voters`` were seen at ``step`` holding ``state_hash``."""
        support = sum(1 for h in self._by_step.get(step, {}).values() if h == state_hash)
        return support > 0 and support >= quorum(max(voters, 1))
