"""Protocol-level attacks on averaging groups, for rehearsal: what a Byzantine leader can try.

Where the attacks in ``attacks`` lie about gradients, these lie about the group itself, whenever the
attacker leads one:

- ``duplicate_member``: lists itself ``copies`` times, to reduce that many parts of the vector;
- ``rewrite_commitments``: replaces every follower's nonce commitment in the gathered data, so that
  honest reducers would drop each other's chunks as bad reveals and keep only the leader's.

Each is an ``Attack`` (honest at the gradient hooks, registered with the others, so ``swarm-sim --attack``
and ``swarm-peer join --rehearse-attack`` take them) whose ``announce_group`` round hook
(``swarm.averaging.hooks``) rewrites the group a leader sends to its followers: the averager's
``RunMatchmaking`` calls it whenever this peer leads. An uncertified reducer needs no attack class: it is
any process without a certificate running an ``Averager`` (``tests/test_stage_security.py`` starts one).
Honest code never builds these.

Example::

    attack = make_attack("rewrite_commitments", group_size=3, attackers=1)
    averager = Averager(dht, prefix="run", numel=n, signing_key=key, hooks=attack)
"""

from __future__ import annotations

import os
from typing import Any

from pydantic import Field

from protocols.codec import pack, unpack
from swarm.byzantine.attacks import Attack, AttackOptions, register_attack


class GroupAttack(Attack):
    """Honest at every gradient hook; ``announce_group`` is where a leading attacker lies about its group."""


class DuplicateMemberOptions(AttackOptions):
    """Options of ``duplicate_member``: ``copies``, how many slots (parts of the vector) the leader takes."""

    copies: int = Field(3, ge=2, le=64, description="slots the leader takes in its own group")


@register_attack("duplicate_member", DuplicateMemberOptions)
class DuplicateMember(GroupAttack):
    """Announces a group that lists the leader ``copies`` times, every copy with the leader's gathered
    entry, so that it reduces that many parts."""

    def announce_group(self, group: Any, leader: Any) -> Any:
        mine = group.gathered[group.peer_ids.index(leader)]
        extra = self.options.copies - 1
        peer_ids, gathered = (
            (leader,) * extra + tuple(group.peer_ids),
            (mine,) * extra + tuple(group.gathered),
        )
        return type(group)(group.group_id, peer_ids, gathered)


def _with_commitment(entry: bytes, commitment: bytes) -> bytes:
    """``entry`` with another commitment: a signed entry keeps its (now wrong) signature."""
    outer = unpack(entry, what="entry")
    if isinstance(outer, dict) and "payload" in outer:
        inner = unpack(outer["payload"], what="entry payload")
        inner["body"]["commit"] = commitment
        return pack({**outer, "payload": pack(inner)})
    return pack({**outer, "commit": commitment})


@register_attack("rewrite_commitments", AttackOptions)
class RewriteCommitments(GroupAttack):
    """Announces the group with a random nonce commitment in every follower's entry (a signed entry keeps
    its now wrong signature), so that honest reducers drop each other's chunks as bad reveals and keep
    only the leader's."""

    def announce_group(self, group: Any, leader: Any) -> Any:
        gathered = tuple(
            entry if peer == leader else _with_commitment(entry, os.urandom(32))
            for peer, entry in zip(group.peer_ids, group.gathered, strict=True)
        )
        return type(group)(group.group_id, tuple(group.peer_ids), gathered)
