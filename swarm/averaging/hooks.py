"""``RoundHooks``: what a member does at each point of a round where a member could lie, honest by default.

A round calls its hooks where this member acts as reducer, validator and group leader; the default does
what an honest peer does (returns its input, or declines to act), so the library calls it
unconditionally. Four typed flags stand where there is nothing to call on the honest path:
``rewrites_aggregates`` spares an honest reducer decoding its own aggregate for ``aggregate``, and the
other three are things an honest member simply never does (return nothing, show nothing, deny a round
it joined):

- ``aggregate(round, part, chunk, honest) -> Tensor``: what this reducer returns for a chunk, given the
  honest aggregate; called only when ``rewrites_aggregates`` is set;
- ``withholds_aggregates``: as reducer or a repair's substitute, stream no aggregate back;
- ``refuses_inputs``: as reducer, show validators none of the inputs it aggregated;
- ``denies_rounds``: as reducer, answer every part stream that it knows no such round, as an honest
  member that left the group would;
- ``show(round, part, chunk, honest) -> SignedInput``: the own input this member shows a validator;
- ``frame(evidence, round) -> Evidence | None``: as validator that cleared a reducer, evidence to accuse
  it with anyway (None: the honest verdict stands);
- ``announce_group(group, leader) -> GroupInfo``: as leader, the group told to the followers (the
  leader itself keeps the group it assembled).

Rehearsed attacks (``swarm.byzantine``) override these; the library never imports them: ``peer`` and
``lab`` build an attack and hand it to ``Trainer`` or ``Averager`` as their hooks.

Example::

    averager = Averager(dht, prefix="run", numel=n, signing_key=key, hooks=RoundHooks())  # honest
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch

if TYPE_CHECKING:
    from hivemind.averaging.group_info import GroupInfo
    from hivemind.p2p import PeerID

    from swarm.averaging.allreduce import ButterflyAllReduce
    from swarm.averaging.evidence import Evidence, SignedInput


class RoundHooks:
    """An honest member of a round: every hook returns what it was given, every flag is off."""

    #: Whether ``aggregate`` may return something other than the honest aggregate.
    rewrites_aggregates: ClassVar[bool] = False
    #: Whether this member, as reducer or substitute, returns no aggregate to the senders.
    withholds_aggregates: ClassVar[bool] = False
    #: Whether this member, as reducer, shows validators none of the inputs it aggregated.
    refuses_inputs: ClassVar[bool] = False
    #: Whether this member, as reducer, says it knows no round of every part stream sent to it.
    denies_rounds: ClassVar[bool] = False

    def aggregate(
        self, round: ButterflyAllReduce, part: int, chunk: int, honest: torch.Tensor
    ) -> torch.Tensor:
        """The values this reducer signs and returns for ``chunk`` of ``part`` (decoded from the wire)."""
        return honest

    def show(self, round: ButterflyAllReduce, part: int, chunk: int, honest: SignedInput) -> SignedInput:
        """This member's own signed input to ``chunk`` of ``part``, as shown to a validator who asks."""
        return honest

    def frame(self, evidence: Evidence, round: ButterflyAllReduce) -> Evidence | None:
        """Evidence to accuse a reducer this validator found honest with; None: accuse nobody."""
        return None

    def announce_group(self, group: GroupInfo, leader: PeerID) -> GroupInfo:
        """The group this peer, leading it as ``leader``, tells its followers."""
        return group


__all__ = ["RoundHooks"]
