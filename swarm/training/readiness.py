"""How much of what other peers claim at this step an ``every_step`` peer counts toward the target batch.

A peer's progress record says how many samples it holds at its step (``ProgressRecordBody.samples``); an
``every_step`` peer computes until its own samples and the others' reach ``training.target_batch_size``,
then starts its round. Nobody can check a record's count while the step runs, so a peer whose last applied
round brought it to this step (``ShownWork``) believes a count only as far as that round showed the
claimant's work:

- A member of that round counts up to the weight it signed there (``CLAIM_GROWTH`` times it), each weight
  first capped at the round's lower median as the robust rules cap it (``validation.fair_weights``), and
  taken as at least the round's ``floor``: the target over the peers the round showed, so a step cut short,
  or members that joined with one micro-batch, do not make the next step's members count for nothing. A
  member whose input this peer's part dropped showed no work and counts nothing.
- Everyone else (the step's other groups, newcomers, identities that were never in a round) shares one
  allowance: the weight the step's other groups brought to the last second-tier round, scaled by the pace
  of the round's members now, and never less than this peer's own samples. The pace is this peer's own
  count over its weight, held between the lower and the upper median of every member's (this peer's
  included): a minority claiming more, or nothing, cannot move it past an honest member's, and the
  groupmate of a group of two cannot move it at all. Each other group weighs its counted signers
  (``tiers.counted_groups``: a strict majority of its members, each signer in one group) at no less than
  the floor and no more than the median member of this peer's round (or the floor) each, so a liar's raw
  weight in a certificate, a group certified twice, or a sliver of weight signed in this round changes
  nothing. Claims past the allowance, however many identities make them, count for nothing.

So, against a peer with its last round behind it: records with no round behind them, or any number of
Sybil records, bring its round forward by at most its own samples beyond the pace the other groups kept
last step (in a swarm of one group the step's batch at worst shrinks by one peer's share); a member of its
last round that claims more counts as the share it brought there (the median member's, or the floor); a
member that claims nothing costs what its silence would; admitted identities that certify a group of
their own and enter the second tier count as that many members. A peer with no round behind it at its
step (a newcomer, a peer that downloaded or adopted its step, every peer at the swarm's first step)
counts claims as made: a record can bring its round forward to its first micro-batch, and its
contribution is then small; the others' steps are set by what they count. What honest peers pay: a peer
faster than the median, or faster than at its last round, is counted by the others at its last share,
so they compute on past the target; and a peer whose last round showed fewer peers than the step now
holds (a swarm that grew, a group that applied its own result after its second tier failed) counts the
newcomers together as at most its own samples for that one step. ``diloco`` windows close by inner steps,
not by these counts (``DilocoSync.window_closed``); this rule is ``every_step``'s alone.

Example::

    shown = ShownWork.of_round(step=5, members=["me", "a", "b"], weights=[64, 64, 64], me="me", target=192)
    counted = counted_claims({"a": 40, "b": 40, "sybil": 10**6}, own=40, shown=shown, step=5)  # [40, 40, 40]
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from swarm.averaging.tiers import counted_groups
from swarm.averaging.validation import fair_weights

#: How far past the weight a member signed in this peer's last round (or the round's floor) its count at a
#: later step is believed: no further, so a member that lies counts as the share it brought there.
CLAIM_GROWTH = 1.0


@dataclass(frozen=True)
class ShownWork:
    """What this peer's last applied round showed of the others' work: the step it brought this peer to,
    each other member's signed weight (capped at the round's lower median; 0 for one whose input this peer's
    part dropped) and this peer's own, the weight of the step's other groups in its second tier (``rest``, 0
    without one), and ``floor``: the target batch over the peers the round showed (its members and the
    other groups' counted signers), below which no member's weight is taken as its pace (after a step cut
    short, or beside members that joined with one micro-batch)."""

    step: int
    weights: Mapping[str, float] = field(default_factory=dict)
    own: float = 0.0
    rest: float = 0.0
    floor: float = 0.0

    @classmethod
    def of_round(
        cls,
        *,
        step: int,
        members: Sequence[str],
        weights: Sequence[float],
        me: str,
        target: int,
        dropped: Collection[str] = (),
        groups: Sequence[dict] = (),
        group_id: bytes = b"",
    ) -> ShownWork:
        """From a round that brought this peer to ``step``: its ``members`` and their signed ``weights`` (this
        peer's included), the members whose input ``dropped`` left out, the checked group certificates of its
        second tier (``groups``; this peer's own group's ID ``group_id``), and the run's ``target`` batch."""
        fair = fair_weights(list(weights)).tolist()
        shown = {m: (0.0 if m in dropped else w) for m, w in zip(members, fair, strict=True) if m != me}
        own = next((w for m, w in zip(members, fair, strict=True) if m == me), 0.0)
        median = max(fair, default=0.0)  # every weight is capped at the lower median
        others = [
            (g, len(signers)) for g, signers in counted_groups(groups, lambda _: True) if g["id"] != group_id
        ]
        floor = target / max(1, len(set(members)) + sum(n for _, n in others))
        # Each other group as its signers' work, in the units of the members' (at least the floor each, at
        # most the median member or the floor each): a sliver of weight signed in this round, or a step cut
        # short, does not empty the other groups' allowance, and a liar's weight in theirs does not swell it.
        rest = math.fsum(min(max(float(g["weight"]), n * floor), n * max(median, floor)) for g, n in others)
        return cls(step, shown, own, rest, floor)

    def believed(self, step: int) -> bool:
        """Only at the step the round brought this peer to: after a download or an adoption claims count as
        made again, as a newcomer's do (a round that no longer shows the swarm would hold the peer back from
        the rounds it joins)."""
        return step == self.step

    def pace(self, own: int, counted: Mapping[str, int]) -> float:
        """How far through its share of the last round's work the round's members are now: this peer's own
        count over its weight (each weight taken as at least ``floor``), held between the lower and the upper
        median of every member's, this peer's included. A minority claiming more, or nothing, cannot move it
        past an honest member's; a groupmate of a group of two moves it not at all."""
        mine = own / max(self.own, self.floor, 1.0)
        ratios = sorted(
            [mine]
            + [n / max(self.weights[p], self.floor, 1.0) for p, n in counted.items() if self.weights[p] > 0]
        )
        return max(ratios[(len(ratios) - 1) // 2], min(mine, ratios[len(ratios) // 2]))


def counted_claims(claims: Mapping[str, int], *, own: int, shown: ShownWork | None, step: int) -> list[int]:
    """The samples of the other peers at ``step`` this peer counts toward the target batch (see the module
    docstring): ``claims`` by peer, from their signed progress records; ``own``: this peer's samples."""
    if shown is None or not shown.believed(step):
        return list(claims.values())
    members = {
        peer: min(
            claim, int(CLAIM_GROWTH * max(shown.weights[peer], shown.floor)) if shown.weights[peer] > 0 else 0
        )
        for peer, claim in claims.items()
        if peer in shown.weights
    }
    allowance = max(own, int(min(shown.rest * shown.pace(own, members), 2.0**62)))
    others = sum(claim for peer, claim in claims.items() if peer not in shown.weights)
    return [*members.values(), min(others, allowance)]


__all__ = ["CLAIM_GROWTH", "ShownWork", "counted_claims"]
