"""Protocol-level attacks on averaging groups, for rehearsal: what a Byzantine leader or outsider can try.

Where ``attacks`` lies about gradients, these lie about the group itself:

- ``duplicate_member``: a leader lists itself ``copies`` times, to reduce that many parts of the vector;
- ``rewrite_commitments``: a leader replaces every follower's nonce commitment in the gathered data, so
  that honest reducers would drop each other's chunks as bad reveals and keep only the leader's;
- ``uncertified_reducer``: a process without a coordinator certificate joins a (stage) averaging
  matchmaking and offers to reduce parts.

Each is a ``GroupAttack`` whose ``announce`` hook rewrites the group a leader sends to its followers.
``attacking_averager(attack)`` is the ``Averager`` subclass that mounts it. Honest code never builds one.

Example::

    attack = make_group_attack("rewrite_commitments")
    averager = attacking_averager(attack)(dht, prefix="run", numel=n, signing_key=key)
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Mapping
from typing import Any

from hivemind.averaging.group_info import GroupInfo
from hivemind.p2p import PeerID
from pydantic import BaseModel, ConfigDict, Field

from protocols.codec import pack, unpack
from swarm.averaging.averager import Averager, RunMatchmaking
from swarm.registry import Registry


class GroupAttackOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")


class GroupAttack:
    """Honest at every hook; each named attack overrides the hooks it lies at."""

    name = "honest"
    #: The attacker holds no coordinator certificate (it never joined the run).
    uncertified = False

    def __init__(self, options: GroupAttackOptions):
        self.options = options

    def announce(self, group: GroupInfo, leader: PeerID) -> GroupInfo:
        """The group this peer, as leader, announces to its followers."""
        return group


GroupAttackFactory = Callable[[Any], GroupAttack]
GROUP_ATTACKS: Registry[GroupAttackFactory] = Registry(kind="group attack", group="swarm.group_attacks")


def group_attack_names() -> list[str]:
    return GROUP_ATTACKS.names()


def make_group_attack(name: str, options: Mapping[str, Any] | None = None) -> GroupAttack:
    """The group attack ``name``; a ConfigError names a bad option and the known attacks."""
    attack = GROUP_ATTACKS.get(name).factory(GROUP_ATTACKS.validate(name, options))
    attack.name = name
    return attack


class DuplicateMemberOptions(GroupAttackOptions):
    copies: int = Field(3, ge=2, le=64, description="slots the leader takes in its own group")


@GROUP_ATTACKS.register("duplicate_member", DuplicateMemberOptions)
class DuplicateMember(GroupAttack):
    def announce(self, group: GroupInfo, leader: PeerID) -> GroupInfo:
        mine = group.gathered[group.peer_ids.index(leader)]
        extra = self.options.copies - 1
        return GroupInfo(
            group.group_id, (leader,) * extra + tuple(group.peer_ids), (mine,) * extra + tuple(group.gathered)
        )


def _with_commitment(entry: bytes, commitment: bytes) -> bytes:
    """``entry`` with another commitment: a signed entry keeps its (now wrong) signature."""
    outer = unpack(entry, what="entry")
    if isinstance(outer, dict) and "payload" in outer:
        inner = unpack(outer["payload"], what="entry payload")
        inner["body"]["commit"] = commitment
        return pack({**outer, "payload": pack(inner)})
    return pack({**outer, "commit": commitment})


@GROUP_ATTACKS.register("rewrite_commitments", GroupAttackOptions)
class RewriteCommitments(GroupAttack):
    def announce(self, group: GroupInfo, leader: PeerID) -> GroupInfo:
        gathered = tuple(
            entry if peer == leader else _with_commitment(entry, os.urandom(32))
            for peer, entry in zip(group.peer_ids, group.gathered, strict=True)
        )
        return GroupInfo(group.group_id, tuple(group.peer_ids), gathered)


@GROUP_ATTACKS.register("uncertified_reducer", GroupAttackOptions)
class UncertifiedReducer(GroupAttack):
    uncertified = True


class _AttackingMatchmaking(RunMatchmaking):
    group_attack: GroupAttack

    async def leader_assemble_group(self) -> GroupInfo:
        group = await super().leader_assemble_group()
        forged = self.group_attack.announce(group, self.peer_id)
        if forged is not group:
            # Followers read the group from this future when they are told to begin.
            announced = asyncio.get_running_loop().create_future()
            announced.set_result(forged)
            self.assembled_group = announced
        return group


def attacking_averager(attack: GroupAttack) -> type[Averager]:
    """An ``Averager`` whose matchmaking mounts ``attack`` whenever this peer leads a group."""
    matchmaking = type(
        f"{type(attack).__name__}Matchmaking", (_AttackingMatchmaking,), {"group_attack": attack}
    )
    return type(f"{type(attack).__name__}Averager", (Averager,), {"matchmaking_type": matchmaking})
