"""``coordinator_sybils``: cheap identities against the coordinator, as a protocol attack for ``swarm-sim``.

Issue 25 item 6, mounted from one address under the default ``open`` admission. Each time it is mounted
the attacker:

- joins ``joins_per_mount`` new identities (up to ``max_identities``), each named with 64 characters;
- heartbeats every identity it holds with 64 metrics under 64-character names, ``contributed_samples``
  of 10^12, and the step and parameter hash the honest peers report in ``Status`` (a freeloader that
  copies the public state to be credited), suspecting every honest peer it saw (to inflate their
  badges);
- asks for ``challenges_per_mount`` join challenges at once (to crowd out honest joiners);
- keeps one stalled accusation open against an honest peer (to reserve the evidence budget);
- has one identity accuse itself with junk evidence (a forged accusation bans its accuser: Sybils that
  ban themselves to crowd the ban list).

The coordinator must stay usable throughout: ``Status`` answers in pages, honest peers keep joining,
heartbeating and training, and the Sybils earn at most the bounded share ``coordinator/credit.py``
allows. ``mount`` returns the requests sent; what the coordinator refused shows in its log and in the
attacker's counts (``refused``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os

from pydantic import Field

from protocols.errors import SwarmError
from protocols.keys import PublicKey, SigningKey
from swarm.byzantine.abuse import challenge_flood, stalled_accusation
from swarm.byzantine.protocol_attacks import (
    ProtocolAttack,
    ProtocolAttackOptions,
    ProtocolTarget,
    register_protocol_attack,
)
from swarm.coordinator_client import CoordinatorClient

logger = logging.getLogger(__name__)

LONG = "s" * 56  # 56 + an 8-digit suffix: the 64 characters a name or metric key may have


class CoordinatorSybilsOptions(ProtocolAttackOptions):
    """How many identities, challenges and accusations the attacker spends."""

    joins_per_mount: int = Field(4, ge=0, le=64, description="new identities joined each time it is mounted")
    max_identities: int = Field(240, ge=0, le=4096, description="identities it holds at most")
    challenges_per_mount: int = Field(64, ge=0, le=10_000, description="join challenges asked for at once")
    metrics: int = Field(
        64, ge=1, le=64, description="metrics per heartbeat: contributed_samples and 64-character keys"
    )


@register_protocol_attack("coordinator_sybils", CoordinatorSybilsOptions)
class CoordinatorSybils(ProtocolAttack):
    """Cheap identities that join, claim credit, inflate suspicions, stall accusations and ban themselves."""

    def __init__(self, options: CoordinatorSybilsOptions) -> None:
        super().__init__(options)
        self.keys: list[SigningKey] = []
        self.coordinator: CoordinatorClient | None = None  # one channel for every identity
        self.coordinator_key: PublicKey | None = None
        self.stall: asyncio.Task | None = None
        self.refused = 0

    async def mount(self, target: ProtocolTarget) -> int:
        if not target.coordinator:
            return 0
        sent = 0
        status = await self.client(target).status(target.run_id)
        honest = [p for p in status.peers if not p.name.startswith(LONG)]
        step, param_hash = max(((p.step, p.param_hash) for p in honest if p.param_hash), default=(0, ""))
        sent += 1 + await self._join(target)
        for key in self.keys:
            sent += 1
            await self._heartbeat(target, key, step, param_hash, [p.peer_id for p in honest][:16])
        flood = await challenge_flood(
            target.coordinator, target.run_id, calls=self.options.challenges_per_mount
        )
        sent += flood.granted + flood.refused
        self.refused += flood.refused
        if honest and self.keys and (self.stall is None or self.stall.done()):
            self.stall = asyncio.create_task(
                stalled_accusation(target.coordinator, self.keys[0], target.run_id, accused=honest[0].peer_id)
            )
            sent += 1
        if len(self.keys) > 1:
            sent += await self._ban_itself(target, self.keys.pop())
        return sent

    async def close(self) -> None:
        if self.stall is not None:
            self.stall.cancel()
            with contextlib.suppress(BaseException):
                await self.stall
        if self.coordinator is not None:
            await self.coordinator.close()

    def client(self, target: ProtocolTarget) -> CoordinatorClient:
        if self.coordinator is None:
            self.coordinator = CoordinatorClient(target.coordinator)
        return self.coordinator

    async def _join(self, target: ProtocolTarget) -> int:
        room = max(0, self.options.max_identities - len(self.keys))
        tried = 0
        for _ in range(min(self.options.joins_per_mount, room)):
            key = SigningKey.generate()
            tried += 2  # a challenge and a join
            try:
                admission = await self.client(target).join(
                    key, target.run_id, name=f"{LONG}{len(self.keys):08d}", device=LONG + "device00"
                )
            except SwarmError as e:
                self.refused += 1
                logger.debug(f"a Sybil's join was refused: {e}")
                continue
            self.coordinator_key = admission.coordinator_key
            self.keys.append(key)
        return tried

    async def _heartbeat(
        self, target: ProtocolTarget, key: SigningKey, step: int, param_hash: str, suspects: list[str]
    ) -> None:
        metrics = {f"{LONG}{i:08d}": float(i) for i in range(self.options.metrics - 1)}
        metrics["contributed_samples"] = 1e12  # the 64th
        try:
            await self.client(target).heartbeat(
                key, target.run_id, self.coordinator_key, metrics=metrics, step=step, param_hash=param_hash,
                suspects=suspects,
            )  # fmt: skip
        except SwarmError as e:
            self.refused += 1
            logger.debug(f"a Sybil's heartbeat was refused: {e}")

    async def _ban_itself(self, target: ProtocolTarget, key: SigningKey) -> int:
        """Accuse itself with junk: the coordinator bans the accuser of evidence that does not parse."""
        try:
            await self.client(target).accuse(
                key,
                target.run_id,
                accused=key.peer_id,
                reason="a Sybil banning itself",
                evidence=os.urandom(256),
            )
        except SwarmError as e:
            self.refused += 1
            logger.debug(f"a Sybil's self-accusation was refused: {e}")
        return 1


__all__ = ["CoordinatorSybils", "CoordinatorSybilsOptions"]
