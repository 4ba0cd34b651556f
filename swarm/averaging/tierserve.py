"""The hand-off of the second tier (``tiers``): a representative's board, its handler, and a member's fetch.

A member of a first-tier group opens one stream to its representative (``rpc_tier_result``) with its
signed attestation of the group's round (``tiercert``) and waits on it for the outcome. The representative
answers at once, refusing, a caller that is not a member of one of its recent first-tier rounds
(``TierServicer.known``), so a stranger holds no stream for long; it keeps the attestations that hold
(``TierBoard.attest``) until a strict majority lets it join the second tier (``TierBoard.majority``), and
streams the outcome (``TierOutcome.answers``) to every member that waits.

In a group larger than ``training.relay_fanout + 1`` the outcome goes down a tree (``tiers.relay_parent``):
a member whose parent is another member sends the representative its attestation alone (``attest_to``,
answered at once) and asks its parent, which opened the group on its own board (``TierBoard.relay``: it
keeps no attestation) and posts there what it checked. Only the representative may say ``alone``: a member
that a relayer tells so, or that its relayer fails or lies to, asks the representative itself.

Example::

    board.open(group_id, members, holds=lambda member, signature: attestation_holds(member, signature, ...))
    signed = await board.majority(group_id, timeout_s=10.0)
    board.post(group_id, outcome)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import AsyncIterator as TypingAsyncIterator  # noqa: UP035 - hivemind reads typing hints

from hivemind.p2p import P2P, P2PContext, PeerID

from protocols import averaging_pb2 as apb
from protocols.errors import ProtocolError, StaleError, SwarmError
from swarm.averaging.allreduce import Traffic
from swarm.averaging.tiers import MAX_TIER_ANSWER_BYTES, TierCheck, TierOutcome
from swarm.inbound import SMALL_REQUEST_BYTES, BoundedServicer, HandlerBound

logger = logging.getLogger(__name__)

#: First-tier groups whose second-tier outcome a representative keeps for its members.
KEPT_OUTCOMES = 8
#: Steps whose combined result a peer keeps for peers that fell behind (``TierBoard.keep``).
KEPT_STEPS = 2
#: How long a member's request waits for its representative to open the group (it may finish first).
OPEN_WAIT_S = 5.0

# Whether ``signature`` is ``member``'s attestation of the group's round as this representative saw it.
Holds = Callable[[str, bytes], bool]


@dataclass
class _Posted:
    members: list[str]
    holds: Holds
    outcome: asyncio.Future
    signed: dict[int, bytes] = field(default_factory=dict)
    changed: asyncio.Event = field(default_factory=asyncio.Event)


class TierBoard:
    """The groups a representative holds, by first-tier group ID (the last ``KEPT_OUTCOMES``)."""

    def __init__(self, kept: int = KEPT_OUTCOMES):
        self.kept = kept
        self._posted: OrderedDict[bytes, _Posted] = OrderedDict()
        self._opened = asyncio.Event()
        self._applied: OrderedDict[int, TierOutcome] = OrderedDict()

    def keep(self, step: int, outcome: TierOutcome) -> None:
        """The combined result this peer applied at ``step``, for a peer that fell behind to adopt."""
        self._applied[step] = outcome
        while len(self._applied) > KEPT_STEPS:
            self._applied.popitem(last=False)

    def applied(self, step: int) -> TierOutcome | None:
        return self._applied.get(step)

    def open(self, group_id: bytes, members: Sequence[str], holds: Holds) -> None:
        """This peer represents ``group_id`` now: its members may attest and wait for the outcome."""
        self._posted[group_id] = _Posted(list(members), holds, asyncio.get_running_loop().create_future())
        while len(self._posted) > self.kept:
            _, old = self._posted.popitem(last=False)
            old.outcome.cancel()
        self._opened.set()
        self._opened = asyncio.Event()

    def relay(self, group_id: bytes, children: Sequence[str]) -> None:
        """This peer passes on ``group_id``'s outcome once it has checked it: its ``children`` in the group's
        relay tree (and nobody else) may wait for it here (``wait``; no attestation is kept)."""
        self.open(group_id, children, holds=lambda member, signature: False)

    def attest(self, group_id: bytes, member: str, signature: bytes) -> None:
        """Keep ``member``'s attestation of ``group_id`` if it holds (a signature that does not is ignored:
        the member waits for an outcome all the same)."""
        posted = self._posted.get(group_id)
        if posted is None or member not in posted.members or not posted.holds(member, signature):
            return
        posted.signed[posted.members.index(member)] = signature
        posted.changed.set()

    async def majority(
        self, group_id: bytes, timeout_s: float, rest_s: float = 0.0
    ) -> dict[int, bytes] | None:
        """The attestations that hold, once a strict majority of the group's members has given one and then
        the others have, or ``rest_s`` more has passed (a certificate with more than a bare majority still
        holds for a peer that no longer counts a signer or two: ``tiers.signed_peers``); None when no
        majority came within ``timeout_s``."""
        posted = self._posted[group_id]
        loop = asyncio.get_running_loop()
        deadline, majority_at = loop.time() + timeout_s, None
        while len(posted.signed) < len(posted.members):
            if majority_at is None and 2 * len(posted.signed) > len(posted.members):
                majority_at = loop.time()
                deadline = min(deadline, majority_at + rest_s)
            posted.changed.clear()
            left = deadline - loop.time()
            if left <= 0:
                break
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(posted.changed.wait(), left)
        return dict(posted.signed) if 2 * len(posted.signed) > len(posted.members) else None

    def post(self, group_id: bytes, outcome: TierOutcome | None) -> None:
        """The outcome of ``group_id`` (None: nothing to apply this time)."""
        posted = self._posted.get(group_id)
        if posted is not None and not posted.outcome.done():
            posted.outcome.set_result(outcome)

    async def take(self, group_id: bytes, asker: str, attestation: bytes, *, open_s: float) -> _Posted:
        """Keep ``asker``'s ``attestation`` of ``group_id`` if it holds, once this peer has opened the group;
        raises ``ProtocolError`` when it does not within ``open_s`` or ``asker`` is not a member."""
        loop = asyncio.get_running_loop()
        open_by = loop.time() + open_s
        while group_id not in self._posted:  # a member may finish the first tier before its representative
            left = open_by - loop.time()
            if left <= 0:
                raise ProtocolError("this peer represents no such group")
            opened = self._opened
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(opened.wait(), left)
        posted = self._posted[group_id]
        if asker not in posted.members:
            raise ProtocolError("not a member of this group")
        self.attest(group_id, asker, attestation)
        return posted

    async def wait(
        self, group_id: bytes, asker: str, attestation: bytes, *, open_s: float, timeout_s: float
    ) -> TierOutcome | None:
        """The outcome for ``asker`` (whose ``attestation`` is kept if it holds); raises ``ProtocolError`` when
        this peer does not represent the group within ``open_s``, or ``TimeoutError``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        posted = await self.take(group_id, asker, attestation, open_s=min(open_s, timeout_s))
        return await asyncio.wait_for(asyncio.shield(posted.outcome), max(0.0, deadline - loop.time()))


class TierServicer(BoundedServicer):
    """A representative's answers to its groups' members (hivemind finds ``rpc_*`` by annotations).

    ``known(group_id, asker)``: whether ``asker`` is a member of a recent first-tier round of this peer
    with that ID; any other caller is refused at once."""

    bounds = {"rpc_tier_result": lambda self: HandlerBound(SMALL_REQUEST_BYTES, 2)}
    reply_bytes = {"rpc_tier_result": MAX_TIER_ANSWER_BYTES}

    def __init__(
        self,
        board: TierBoard,
        *,
        known: Callable[[bytes, str], bool],
        wait_s: Callable[[], float],
        admission: Callable,
        traffic: Traffic,
    ):
        self.board, self.known, self.wait_s, self._admission, self.traffic = (
            board,
            known,
            wait_s,
            admission,
            traffic,
        )

    async def admission(self, peer_id: str) -> str | None:
        return await self._admission(peer_id)

    async def rpc_tier_result(
        self, request: apb.TierRequest, context: P2PContext
    ) -> TypingAsyncIterator[apb.TierAnswer]:
        asker, group_id = context.remote_id.to_base58(), bytes(request.group_id)
        if not group_id:  # a peer that fell behind: the combined result of that step, if this peer kept one
            kept = self.board.applied(request.step)
            if kept is None:
                yield apb.TierAnswer(
                    code=apb.NOT_IN_GROUP, error=f"no combined result of step {request.step} kept here"
                )
                return
            for answer in kept.answers():
                self.traffic.sent += len(answer.chunk.data)
                yield answer
            return
        if not self.known(group_id, asker):
            yield apb.TierAnswer(
                code=apb.NOT_IN_GROUP, error="no recent round of this peer has that ID and caller"
            )
            return
        try:
            if request.attest_only:  # its outcome comes down the relay tree: keep the attestation only
                await self.board.take(group_id, asker, bytes(request.attestation), open_s=OPEN_WAIT_S)
                yield apb.TierAnswer(code=apb.OK)
                return
            outcome = await self.board.wait(
                group_id, asker, bytes(request.attestation), open_s=OPEN_WAIT_S, timeout_s=self.wait_s()
            )
        except ProtocolError as e:
            yield apb.TierAnswer(code=apb.NOT_IN_GROUP, error=str(e))
            return
        except (asyncio.TimeoutError, asyncio.CancelledError):
            yield apb.TierAnswer(code=apb.CANCELLED, error="the second tier has not finished here in time")
            return
        if outcome is None:
            yield apb.TierAnswer(code=apb.CANCELLED, error="nothing to apply for this group this time")
            return
        for answer in outcome.answers():
            self.traffic.sent += len(answer.chunk.data)
            yield answer


@contextlib.asynccontextmanager
async def _answers(
    p2p: P2P, peer: PeerID, namespace: str, request: apb.TierRequest, *, open_s: float
) -> AsyncIterator[AsyncIterator[apb.TierAnswer]]:
    """``peer``'s stream of answers to ``request``, opened within ``open_s`` and closed on leaving."""
    stub = TierServicer.get_stub(p2p, peer, namespace=namespace)
    stream: AsyncIterator[apb.TierAnswer] = await asyncio.wait_for(stub.rpc_tier_result(request), open_s)
    try:
        yield stream
    except StopAsyncIteration:
        raise SwarmError(f"{peer} ended its answer early") from None
    finally:
        if hasattr(stream, "aclose"):
            with contextlib.suppress(Exception):
                await stream.aclose()


async def fetch_tier_header(
    p2p: P2P,
    holder: PeerID,
    namespace: str,
    request: apb.TierRequest,
    *,
    timeout_s: float,
    check: Callable[[apb.TierAnswer], TierCheck],
) -> TierCheck | None:
    """The checked header (``check``) of the combined result ``holder`` (a peer a step ahead) kept for the step
    ``request`` names, its chunks left unread; None when its group was alone. Within ``timeout_s`` in all."""
    async with asyncio.timeout(timeout_s):
        async with _answers(p2p, holder, namespace, request, open_s=timeout_s) as stream:
            first = await stream.__anext__()
            _refused(first, holder)
            return None if first.alone else check(first)


def _refused(first: apb.TierAnswer, peer: PeerID) -> None:
    """Raise when ``peer``'s first answer is not ``OK`` (honest when its second tier failed: no proof)."""
    if first.code != apb.OK:
        raise SwarmError(f"{peer} answered {apb.Code.Name(first.code)}: {first.error[:200]}")


async def attest_to(
    p2p: P2P, representative: PeerID, namespace: str, group_id: bytes, attestation: bytes, *, timeout_s: float
) -> None:
    """Send ``representative`` this peer's attestation of ``group_id`` alone (the outcome comes from a relayer);
    raises ``SwarmError`` or ``TimeoutError`` when it was not taken."""
    request = apb.TierRequest(group_id=group_id, attestation=attestation, attest_only=True)

    async def ask() -> None:
        async with _answers(p2p, representative, namespace, request, open_s=timeout_s) as stream:
            _refused(await stream.__anext__(), representative)

    await asyncio.wait_for(ask(), timeout_s)


async def fetch_tier_result(
    p2p: P2P,
    representative: PeerID,
    namespace: str,
    request: apb.TierRequest,
    *,
    timeout_s: float,
    check: Callable[[apb.TierAnswer], TierCheck],
    chunk_timeout_s: float,
    traffic: Traffic,
) -> TierCheck | None:
    """Ask ``representative`` (or a relayer: a member above this one in the group's relay tree) for the second
    tier's outcome of the group ``request`` names (with this peer's attestation): None when the group was
    the step's only one (``alone``), else the checked result (``TierCheck.output``; ``check`` builds the
    check from the header). Raises ``ProtocolError`` when what it sent does not hold (a proof against it),
    another ``SwarmError`` or ``TimeoutError`` when it sent nothing usable (which an honest one may do)."""
    async with _answers(p2p, representative, namespace, request, open_s=chunk_timeout_s) as stream:
        first = await asyncio.wait_for(stream.__anext__(), timeout_s)
        _refused(first, representative)
        if first.alone:
            return None
        checked = check(first)
        for part, chunk in checked.expected():
            answer = await asyncio.wait_for(stream.__anext__(), chunk_timeout_s)
            traffic.received += len(answer.chunk.data)
            checked.take(part, chunk, answer.chunk)
        return checked


async def fetch_down_the_tree(
    p2p: P2P,
    namespace: str,
    request: apb.TierRequest,
    *,
    representative: PeerID,
    parent: PeerID,
    check: Callable[[apb.TierAnswer], TierCheck],
    timeout_s: float,
    chunk_timeout_s: float,
    traffic: Traffic,
    suspect: Callable[[str, str], None],
) -> TierCheck | None:
    """A member's outcome of the group ``request`` names (``fetch_tier_result``'s answer), within about
    ``timeout_s`` in all, as when it asked its representative alone: from ``parent``, its relayer in the
    group's tree (``tiers.relay_parent``), within half of it (the header and every chunk), while its
    attestation goes to ``representative`` alone; then from the representative itself when the parent is
    the representative, runs out of that half, fails, sends what does not hold (``suspect``ed, with the
    reason) or says ``alone`` (which only the representative may say). Raises as ``fetch_tier_result``
    does for the representative's answer (a representative that sent what does not hold is ``suspect``ed
    too). Entries or chunks dated out of bounds (``StaleError``) are signed by others and blame nobody."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    if parent != representative:
        attesting = asyncio.create_task(
            attest_to(
                p2p,
                representative,
                namespace,
                request.group_id,
                request.attestation,
                timeout_s=OPEN_WAIT_S + chunk_timeout_s,
            )
        )
        try:
            relayed = await asyncio.wait_for(
                fetch_tier_result(
                    p2p,
                    parent,
                    namespace,
                    request,
                    timeout_s=timeout_s / 2,
                    check=check,
                    chunk_timeout_s=chunk_timeout_s,
                    traffic=traffic,
                ),
                timeout_s / 2,
            )
            if relayed is not None:
                await _attested(attesting, representative)
                return relayed
            logger.info(f"relayer {parent} says the group was alone; asking its representative")
        except StaleError as e:
            logger.info(f"relayer {parent} passed on a second-tier result dated out of bounds: {e}")
        except ProtocolError as e:
            suspect(parent.to_base58(), f"relayed a second-tier result that does not hold: {e}")
        except Exception as e:  # refused, timed out, or its stream broke: nothing proves a fault
            logger.info(f"no second-tier result from relayer {parent}: {e!r}; asking the representative")
        attesting.cancel()  # the request to the representative carries the attestation again
    try:
        return await fetch_tier_result(
            p2p, representative, namespace, request, timeout_s=max(0.1, deadline - loop.time()),
            check=check, chunk_timeout_s=chunk_timeout_s, traffic=traffic,
        )  # fmt: skip
    except StaleError:
        raise
    except ProtocolError as e:
        suspect(representative.to_base58(), f"sent a second-tier result that does not hold: {e}")
        raise


async def _attested(attesting: asyncio.Task, representative: PeerID) -> None:
    try:
        await attesting
    except Exception as e:  # it may count this member out; the member has its outcome all the same
        logger.info(f"representative {representative} did not take this member's attestation: {e!r}")


__all__ = [
    "KEPT_OUTCOMES",
    "KEPT_STEPS",
    "TierBoard",
    "TierServicer",
    "attest_to",
    "fetch_down_the_tree",
    "fetch_tier_header",
    "fetch_tier_result",
]
