"""The run's standing as a peer last heard it: each credited peer's samples, signed by the coordinator.

The coordinator credits a data-parallel peer only for rounds other members witnessed
(``coordinator.credit``), and signs the credited samples of the online, unbanned peers with the most into
its answer to a heartbeat whose copy is older (``protocols.messages.RunStateBody.standing``). Catch-up
weighs votes by it (``swarm.training.catchup``): identities that did no witnessed work have no say.
The session keeps the newest copy; the trainer's catch-up reads it.

Example::

    standing = Standing()
    standing.take(answer.standing_at, answer.standing)
    standing.credit.get(peer_id, 0.0)
"""

from __future__ import annotations

from collections.abc import Mapping


class Standing:
    """The newest standing this peer was sent (``at``: the coordinator's clock when it computed it)."""

    def __init__(self) -> None:
        self.at = 0.0
        self.credit: dict[str, float] = {}

    def take(self, at: float, credit: Mapping[str, float] | None) -> bool:
        """Keep ``credit`` if it is newer than the one held; True if it was taken."""
        if credit is None or at <= self.at:
            return False
        self.at, self.credit = at, dict(credit)
        return True
