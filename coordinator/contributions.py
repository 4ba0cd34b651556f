"""How the coordinator judges a sender check: it recomputes the accused sender's contribution itself.

``wrong_contribution`` evidence (``swarm.training.sendercheck``) holds a sender's signed input to one
chunk of a round and its signed group entry, which names the step and the state hash it computed at.
The coordinator checks both signatures and that the entry is the one the sender joined that round with
(its nonce commitment is in the round's digest), then downloads that state by its hash from the accuser,
which keeps it for ``KEEP_S`` after filing: the bytes must hash to what the accused signed, so the
accuser cannot pass off another state. It replays the accused's micro-batches from their public seeds
on CPU, encodes the chunk with the round's codec and compares, with the run's tolerance:

- beyond the tolerance (or a claim of samples the built-in loop never signs): the accused is banned;
- within it, or evidence that does not hold (a signature, an entry of another round, a chunk outside
  the run's layout, a chunk, validator or sender other than the round's draw from its reveals, a run
  that does not check senders, an undrawn sender that neither stands out nor, put by the part's reducer
  the chunk's draw has score its fit, fits its drawn micro-batch worse than the chunk's other inputs):
  the accuser is banned, as for any false evidence;
- the state not served in time (the accuser is gone, or it never kept it), or a replay (or a fit) the
  coordinator cannot run within ``REPLAY_TIMEOUT_S``: nobody is banned.

The recompute costs the coordinator one peer's step on CPU (at most the run's target batch) and one state
download, once per accusation; the accusation budgets bound how many arrive (``coordinator.limits``).

Example::

    states = PeerContributionStates(run, p2p)
    found, guilty = await judge_contribution(run, layouts, data, accused, accuser, states=states,
                                             judging=lock, timeout_s=60)
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from hivemind.p2p import P2P, PeerID

from coordinator.checkpoints import state_layout
from protocols.codec import unpack
from protocols.errors import ProtocolError, SwarmError
from protocols.messages import JUDGING_BUDGET_S
from swarm.averaging.evidence import MAX_EVIDENCE_BYTES, MAX_EVIDENCE_ITEMS
from swarm.averaging.tiers import round_codec
from swarm.config import RunConfig, sender_checks_on
from swarm.training.contribution import WrongContributionEvidence
from swarm.training.state import DecodedState
from swarm.training.sync import download_limit, download_state, state_namespace

logger = logging.getLogger(__name__)

#: The longest one replay may take on the coordinator's CPU before it gives up (banning nobody).
REPLAY_TIMEOUT_S = JUDGING_BUDGET_S


class ContributionStates:
    """Where the coordinator gets the state a sender check was computed on: this base cannot, so such
    evidence bans nobody."""

    async def fetch(self, holder: str, step: int, state_hash: str) -> DecodedState | None:
        """The run's state of ``state_hash`` at ``step`` from ``holder``, verified; None if not served."""
        return None


class PeerContributionStates(ContributionStates):
    """States downloaded from the accuser over the run's state protocol; the last one is kept for the
    next accusation of the same state."""

    def __init__(self, run: RunConfig, p2p: P2P):
        self.run, self.p2p = run, p2p
        self.max_bytes: int | None = None  # the state's size bound, computed at the first download
        self._lock = asyncio.Lock()
        self._last: DecodedState | None = None

    async def fetch(self, holder: str, step: int, state_hash: str) -> DecodedState | None:
        async with self._lock:
            last = self._last
            if last is not None and (last.step, last.state_hash) == (step, state_hash):
                return last
            run = self.run
            if self.max_bytes is None:
                self.max_bytes = await asyncio.to_thread(state_limit, run)
            try:
                state = await download_state(
                    self.p2p, PeerID.from_base58(holder), namespace=state_namespace(run.run_id),
                    run_id=run.run_id, min_step=step, expected_hash=state_hash, exact=True,
                    max_bytes=self.max_bytes, timeout_s=run.training.averaging_timeout_s,
                )  # fmt: skip
            except asyncio.CancelledError:
                raise
            except Exception as e:  # refused, unreachable, or bytes that do not hash to it
                logger.info(f"{holder} did not serve the state {state_hash[:12]} of step {step}: {e!r}"[:500])
                return None
            self._last = state
            return state


def state_limit(run: RunConfig) -> int:
    """The most bytes a download of the run's data-parallel state may carry (as the checkpoint keeper
    bounds its own downloads of it)."""
    return download_limit(sum(size for _, size in state_layout(run).values()))


def _parse(data: bytes) -> WrongContributionEvidence:
    body = unpack(
        data, what="evidence", max_bytes=MAX_EVIDENCE_BYTES, max_binary=MAX_EVIDENCE_BYTES,
        max_items=MAX_EVIDENCE_ITEMS,
    )  # fmt: skip
    if not isinstance(body, dict):
        raise ProtocolError("evidence is not a map")
    return WrongContributionEvidence.from_body(body)


def _holds(
    evidence: WrongContributionEvidence, run: RunConfig, codec, vector_numel: int, accuser: str
) -> tuple[int, str, bool]:
    """(step, state hash, whether the draw named the accused) once the evidence's signatures, layout and
    draw hold; a sender the draw did not name must still be shown to stand out (``check_stands_out``)."""
    step, state_hash = evidence.facts()
    evidence.slice(codec, vector_numel)
    return step, state_hash, evidence.check_draw(run, codec, vector_numel, accuser)


async def judge_contribution(
    run: RunConfig,
    layouts: Callable[[], dict[str, int]],
    data: bytes,
    accused: str,
    accuser: str,
    *,
    states: ContributionStates,
    judging: asyncio.Lock,
    timeout_s: float,
    banned: Callable[[str], Awaitable[str | None]] | None = None,
) -> tuple[str, str | None]:
    """(what was found, who is guilty) for ``wrong_contribution`` evidence (see the module docstring);
    ``banned``: why the accused is convicted, read when this judgment's turn comes (no replay of a peer
    convicted meanwhile)."""
    try:
        evidence = await asyncio.to_thread(_parse, data)
        if evidence.accused != accused or accuser not in evidence.members or accuser == accused:
            raise ProtocolError("the evidence names another culprit, or a round the accuser was not in")
        if not sender_checks_on(run):
            raise ProtocolError("this run does not recompute senders' contributions")
        if evidence.prefix != run.run_id.replace(".", "_"):
            raise ProtocolError(
                f"the evidence is of averaging prefix {evidence.prefix[:80]!r}, not the run's"
            )
        codec, vector_numel = round_codec(run, evidence.prefix), layouts()[evidence.prefix]
        step, state_hash, drawn = await asyncio.to_thread(_holds, evidence, run, codec, vector_numel, accuser)
    except SwarmError as e:
        return f"the evidence does not hold: {e}", accuser
    # The state is downloaded once this judgment's turn comes: a queue of judgments holds no states.
    async with judging:
        reason = await banned(accused) if banned is not None else None
        if reason is not None:
            return (
                f"{accused} was convicted while this accusation waited ({reason}); nobody banned again",
                None,
            )
        # Decoding and scoring every input of the chunk: one judgment at a time, as any. A sender that does
        # not stand out may still fit its own drawn micro-batch worse than the others, which takes the state.
        stands_out = drawn
        if not drawn:
            try:
                await asyncio.to_thread(evidence.check_stands_out, run, codec, vector_numel, accuser)
                stands_out = True
            except SwarmError as e:
                try:  # only the part's reducer the chunk's draw has score the accused may ask for a fit
                    await asyncio.to_thread(evidence.check_fit_scorer, run, codec, vector_numel, accuser)
                except SwarmError as e2:
                    return f"the evidence does not hold: {e}; {e2}", accuser
        try:
            async with asyncio.timeout(timeout_s):
                state = await states.fetch(accuser, step, state_hash)
        except TimeoutError:
            state = None
        if state is None:
            return (
                f"the accuser did not serve the state {state_hash[:12]} of step {step} it recomputed "
                f"{accused}'s contribution on; nobody banned",
                None,
            )
        if not stands_out:
            try:
                await asyncio.to_thread(
                    evidence.check_fits_poorly, run, state.tensors, codec, vector_numel, device="cpu",
                    deadline=time.monotonic() + REPLAY_TIMEOUT_S,
                )  # fmt: skip
            except ProtocolError as e:
                return f"the evidence does not hold: {e}", accuser
            except Exception as e:  # a fit this coordinator cannot compute (in time) bans nobody, as a replay
                logger.warning(f"could not score the fit of {accused} at step {step}: {e!r}"[:500])
                return f"the coordinator could not score the fit of {accused}: {e}"[:400], None
        try:
            verdict = await asyncio.to_thread(
                evidence.judge, run, state.tensors, codec, vector_numel=vector_numel, device="cpu",
                deadline=time.monotonic() + REPLAY_TIMEOUT_S,
            )  # fmt: skip
        except Exception as e:  # the evidence held: a replay this coordinator cannot run bans nobody
            logger.warning(f"could not replay {accused}'s contribution at step {step}: {e!r}"[:500])
            return f"the coordinator could not replay {accused}'s contribution: {e}"[:400], None
    if verdict is None:
        return f"{accused}'s contribution is what its public batch seeds give at step {step}", accuser
    return verdict, accused


__all__ = ["ContributionStates", "PeerContributionStates", "judge_contribution", "state_limit"]
