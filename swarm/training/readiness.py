"""How much of what other peers claim at this step an ``every_step`` peer counts toward the target batch.

A peer's progress record says how many samples it holds at its step (``ProgressRecordBody.samples``); an
``every_step`` peer computes until its own samples and the others' reach ``training.target_batch_size``,
then starts its round. Nobody can check a record's count while the step runs, so once the peer has a
round behind it (``ShownWork``: its last applied round, believed for ``SHOWN_FOR_STEPS`` steps) a count is
believed only as far as that round showed the claimant's work:

- A member of that round counts up to ``CLAIM_GROWTH`` times the weight it signed there, each weight first
  capped at the round's lower median as the robust rules cap it (``validation.fair_weights``): a rule
  credits a sender no more, and an honest peer's rate changes little from one step to the next. A member
  whose input this peer's part dropped showed no work.
- Everyone else (the step's other groups, newcomers, identities that were never in a round) shares one
  allowance: the weight the step's other groups brought to the last second-tier round, at the pace of this
  peer's own group now (that weight times what the group counts now over what it signed then), and never
  less than this peer's own samples. Each other group weighs at most its counted signers (``tiers.
  counted_groups``: a strict majority of its members, each signer in one group) times the median member of
  this peer's round, so a liar's raw weight in a certificate, or a group certified twice, adds nothing.
  Claims past the allowance, however many identities make them, count for nothing.

So, against a peer with a round behind it: records with no round behind them, or any number of Sybil
records, bring its round forward by at most its own samples beyond the pace the other groups kept last
step (in a swarm of one group the step's batch at worst halves; before, one record claiming the target
cut every peer's step to one micro-batch); a member of its last round counts as at most twice the median
member; and admitted identities that certify a group of their own and enter the second tier count as that
many median members. A peer with no round behind it (a newcomer, a peer that only downloaded or adopted
for ``SHOWN_FOR_STEPS`` steps, every peer at the swarm's first step) counts claims as made: a record can
bring its round forward to its first micro-batch, and its contribution is then small; the others' steps
are set by what they count. What honest peers pay: a peer faster than the median is counted by the
others at twice the median peer at most, so they compute on past the target. ``diloco`` windows close by
inner steps, not by these counts (``DilocoSync.window_closed``); this rule is ``every_step``'s alone.

Example::

    shown = ShownWork.of_round(step=5, members=["me", "a", "b"], weights=[64, 64, 64], me="me")
    counted = counted_claims({"a": 40, "b": 40, "sybil": 10**6}, own=40, shown=shown, step=5)  # [40, 40, 40]
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from swarm.averaging.tiers import counted_groups
from swarm.averaging.validation import fair_weights

#: How far past the weight a member signed in this peer's last round its count at a later step is believed.
CLAIM_GROWTH = 2.0
#: For how many steps after that round its weights are believed (then claims count as made).
SHOWN_FOR_STEPS = 8


@dataclass(frozen=True)
class ShownWork:
    """What this peer's last applied round showed of the others' work: the step it brought this peer to,
    each other member's signed weight (capped at the round's lower median; 0 for one whose input this peer's
    part dropped), the group's total of those weights with this peer's own (``group``), and the weight of
    the step's other groups in its second tier (``rest``, 0 without one)."""

    step: int
    weights: Mapping[str, float] = field(default_factory=dict)
    group: float = 0.0
    rest: float = 0.0

    @classmethod
    def of_round(
        cls,
        *,
        step: int,
        members: Sequence[str],
        weights: Sequence[float],
        me: str,
        dropped: Collection[str] = (),
        groups: Sequence[dict] = (),
        group_id: bytes = b"",
    ) -> ShownWork:
        """From a round that brought this peer to ``step``: its ``members`` and their signed ``weights`` (this
        peer's included), the members whose input ``dropped`` left out, and the checked group certificates of
        its second tier (``groups``; this peer's own group's ID ``group_id``)."""
        fair = fair_weights(list(weights)).tolist()
        shown = {m: (0.0 if m in dropped else w) for m, w in zip(members, fair, strict=True) if m != me}
        own = next((w for m, w in zip(members, fair, strict=True) if m == me), 0.0)
        median = max(fair, default=0.0)  # every weight is capped at the lower median
        return cls(step, shown, math.fsum([own, *shown.values()]), _other_groups(groups, group_id, median))

    def believed(self, step: int) -> bool:
        return self.step <= step <= self.step + SHOWN_FOR_STEPS


def _other_groups(groups: Sequence[dict], group_id: bytes, median: float) -> float:
    """The weight of the second tier's groups other than ``group_id``: each certificate that counts (a
    strict majority of its members signed it, each signer in one certificate) at most its signers times
    ``median``, this peer's round's median member."""
    counted = counted_groups(groups, lambda _: True)
    return math.fsum(
        min(float(g["weight"]), len(signers) * median) for g, signers in counted if g["id"] != group_id
    )


def counted_claims(claims: Mapping[str, int], *, own: int, shown: ShownWork | None, step: int) -> list[int]:
    """The samples of the other peers at ``step`` this peer counts toward the target batch (see the module
    docstring): ``claims`` by peer, from their signed progress records; ``own``: this peer's samples."""
    if shown is None or not shown.believed(step):
        return list(claims.values())
    counted = [
        min(claim, int(CLAIM_GROWTH * shown.weights[peer]))
        for peer, claim in claims.items()
        if peer in shown.weights
    ]
    pace = (own + sum(counted)) / shown.group if shown.group > 0 else 0.0
    allowance = max(own, int(min(shown.rest * pace, 2.0**62)))
    counted.append(min(sum(claim for peer, claim in claims.items() if peer not in shown.weights), allowance))
    return counted


__all__ = ["CLAIM_GROWTH", "SHOWN_FOR_STEPS", "ShownWork", "counted_claims"]
