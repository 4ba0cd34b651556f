"""Findings of a second attacker's read of the coordinator's judging turns, now regression tests (each
failed before its fix): an unshown-input accusation reads what expires and demands the inputs as it
arrives, not at a judging turn; and a sender-check liar that banned itself as a false accuser is still
convicted by the true evidence against it. Loopback and in process only.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import torch
from helpers import ServedStates, relay_from
from test_evidence import PREFIX, VECTOR, signed_round, unshown
from test_evidence import RUN as EVIDENCE_RUN
from test_judging_redteam import accuse, admitted_keys, serving
from test_sendercheck import RUN as SENDER_RUN
from test_sendercheck import STEP, _evidence

from coordinator.judging import JudgingTurns, judging_for
from coordinator.roundinputs import RoundInputs, judge_unshown
from protocols.keys import SigningKey
from swarm.averaging.evidence import INPUT_DEMAND_WINDOW_S, draw_seed, drawn_validator
from swarm.config import RunConfig
from swarm.models import build_model
from swarm.training.sendercheck import recompute
from swarm.training.state import DecodedState, build_optimizer, state_hash, state_tensors

pytestmark = pytest.mark.timeout(120)


# --- 1. an unshown-input judgment reads what expires only once it has had a judging turn ------------------


class _Withholding(RoundInputs):
    """A reducer that will not show the coordinator the inputs it signed it aggregated; records when asked."""

    can_ask = True

    def __init__(self, clock: list[float]):
        self.clock, self.asked_at = clock, []

    async def fetch(self, evidence, sender_index):
        self.asked_at.append(self.clock[0])
        return None


@pytest.mark.timeout(60)
def test_an_unshown_input_accusation_demands_the_inputs_as_it_arrives_not_at_its_judging_turn():
    """Was MEDIUM. Attack: a reducer withholds an input it signed it aggregated (its drawn validator then files
    true ``unshown_input`` evidence). Meanwhile Sybils of a few other caller addresses keep the judging lock
    busy with recomputes that ban nobody (a sender check whose accuser serves the state slowly holds the
    lock up to ``stage_state_timeout_s``, 120 s; a DiLoCo window replay up to 300 s). ``judge_unshown``
    takes the judging lock (for ``evidence.check``, which needs the layout) BEFORE it reads the signing
    age, whether the reducer is online (``joined_at``) and before it demands the inputs. So the facts that
    expire are read at the turn, not at arrival, although ``coordinator/judging.py`` says "What expires
    (a stage's states, the inputs a reducer keeps, whether the accused is online) is read before that,
    when the evidence arrives", and ``judge_unshown``'s own docstring says ``joined_at`` "is read when
    the evidence arrives". Once the turns ahead of it add up past ``INPUT_DEMAND_WINDOW_S`` (600 s after
    signing; the validator files some time after the signed time, which the reducer may also date back
    by up to 120 s; a victim waits for one recompute of each other address with one waiting, so a few
    120 s stalls, or two 300 s replays, suffice), the verdict is "past the window, nobody banned"; a reducer that
    leaves while the accusation waits is likewise found "not online". This is e485ee3's defect ("judged
    ... unshown inputs after what they need had expired"), which a5ab504 says it replaced, surviving on
    the unshown-input path; docs/robustness.md lists only the sender check's 900 s state as outlasted.

    Impact: a lying/withholding reducer escaped conviction at the cost of a few Sybil recomputes. Now the
    age, the session and the demand are read and made as the evidence arrives, off the lock; the reducer
    that shows nothing is convicted without a turn (there is nothing to recompute)."""
    keys = [SigningKey.generate() for _ in range(3)]
    run = RunConfig(run_id=EVIDENCE_RUN, model={"name": "gpt", "config": {"d_model": 32, "n_layer": 1}},
                    training={"compression": "fp16", "aggregator": "centered_clip"})  # fmt: skip
    lying = signed_round(keys, shift=0.5)
    evidence = unshown(lying, (0,))  # nobody showed the reducer's own input
    reducer = keys[0].peer_id
    accuser = keys[drawn_validator(draw_seed(evidence.digest, evidence.reveals), 0, len(keys))].peer_id
    signed_s = lying.signed_at_ms / 1000

    async def verdict(*, queued_s: float) -> tuple[tuple[str, str | None], list[float], list[float]]:
        clock = [signed_s + 10.0]  # the validator's evidence arrives 10 s after the reducer signed
        inputs, online_read_at = _Withholding(clock), []

        async def joined_at(peer_id: str) -> float | None:
            online_read_at.append(clock[0])
            return signed_s - 600.0  # online all along, since well before it signed

        turns, release = JudgingTurns(), asyncio.Event()

        async def other_address_recompute() -> None:  # a Sybil's sender check, say, holding the lock
            with judging_for("198.51.100.7"):
                async with turns:
                    await release.wait()

        holder = asyncio.create_task(other_address_recompute()) if queued_s else None
        await asyncio.sleep(0)
        with judging_for("203.0.113.5"):  # the validator's address; the task copies this context
            judgment = asyncio.create_task(
                judge_unshown(
                    run,
                    lambda: {PREFIX: VECTOR},
                    evidence.to_bytes(),
                    reducer,
                    accuser,
                    inputs=inputs,
                    joined_at=joined_at,
                    judging=turns,
                    now=lambda: clock[0],
                )  # fmt: skip
            )
        if holder is not None:
            # The reducer is asked, and its session read, at arrival, while another address holds the lock.
            found = await asyncio.wait_for(judgment, 30)
            assert turns.locked() and turns.waiting == 0, "the demand took no judging turn"
            clock[0] += queued_s  # the other addresses' recomputes take their time
            release.set()
            await holder
            return found, online_read_at, inputs.asked_at
        return await asyncio.wait_for(judgment, 30), online_read_at, inputs.asked_at

    # Judged at once, the withholding reducer is convicted.
    (found, guilty), _, asked = asyncio.run(verdict(queued_s=0))
    assert guilty == reducer and "did not show the coordinator" in found, found
    assert asked == [signed_s + 10.0]
    # With another address's recompute holding the lock for ten minutes, the same: asked at arrival.
    (found, guilty), online_read_at, asked = asyncio.run(verdict(queued_s=INPUT_DEMAND_WINDOW_S))
    assert guilty == reducer and "did not show the coordinator" in found, found
    assert asked == [signed_s + 10.0] and online_read_at == [signed_s + 10.0]


# --- 2. a sender-check liar that banned itself as a false accuser keeps the weaker ban -------------------


@pytest.mark.timeout(120)
def test_a_sender_check_liar_pre_banned_as_a_false_accuser_is_still_convicted(tmp_path: Path):
    """Was LOW. Attack: a peer that lies in its contributions first files one junk accusation and is banned as
    a false accuser. Its validator's TRUE sender-check evidence then arrives; ``CoordinatorService._judge``
    answers "already banned" for any ``wrong_contribution`` evidence against a banned peer, whatever kind
    of ban it holds, so the conviction is never recorded: the ban stays a false accuser's (no evidence
    kept, the reason says "false accusation"), although ``ban_sync`` lets a conviction replace a false
    accuser's ban precisely so that it ranks with convictions. ``enforced_bans_sync`` puts every
    conviction before every false accuser, and among false accusers each address's first before its
    second, newest first: so every fresher self-ban from another address (an IPv6 /64 each; a /48 holds
    65,536) outranks the liar, and ~25,600 of them push it off the signed list, which a conviction
    never falls off (the case ``test_a_fresh_conviction_heads_a_ban_list_full_of_self_banned_sybils``
    guards). Off the list, peers stop refusing it while its last certificate (``certificate_ttl_s``,
    1 h, plus 600 s grace) is valid; the operator's audit trail also loses the evidence of the lie. The
    test shows the control (not pre-banned: replayed, convicted, evidence kept, heads the list) and the
    attack (not judged, false-accuser ban kept, ranked behind five fresher self-bans from five
    addresses).

    Impact: small (still banned at the coordinator; dropping it from peers' lists takes thousands of
    addresses' self-bans within its certificate's life). Pre-existing for all kinds before a5ab504,
    which narrowed the skip to sender checks.

    Now a sender check is skipped only when the standing ban is a conviction or an operator's
    (``Store.conviction``); otherwise it is judged, and the conviction replaces the false accuser's ban
    as ``ban_sync`` intends."""
    torch.manual_seed(0)
    keys = [SigningKey.generate() for _ in range(3)]
    model = build_model(SENDER_RUN.model.name, SENDER_RUN.model.config, seed=SENDER_RUN.training.seed)
    tensors = state_tensors(model, build_optimizer(model, SENDER_RUN.optimizer))
    hash_ = state_hash(STEP, tensors)
    honest = recompute(SENDER_RUN, tensors, keys[1].peer_id, STEP, 2, device="cpu")
    validator, liar, third = keys
    true_evidence = _evidence(keys, -honest, hash_=hash_).to_bytes()  # the liar sent its gradient flipped
    sybils = [SigningKey.generate() for _ in range(5)]

    async def scenario(pre_banned: bool, where: Path):
        served = ServedStates(DecodedState(STEP, tensors, {}, hash_))
        async with serving(where, SENDER_RUN, contribution_states=served) as (address, store, _service):
            await admitted_keys(address, SENDER_RUN.run_id, [*keys, *sybils])
            if pre_banned:  # one junk accusation: the liar bans itself as a false accuser
                junk = await accuse(address, liar, third.peer_id, b"\x01" * 64, SENDER_RUN.run_id)
                assert junk.banned_peer == liar.peer_id
            host, port = address.rsplit(":", 1)
            relays = [await relay_from(f"127.0.0.{2 + i}", (host, int(port))) for i in range(len(sybils))]
            try:  # self-banned Sybils, each from an address of its own, newer than the liar's ban
                for sybil, relay in zip(sybils, relays, strict=True):
                    sybil_at = f"127.0.0.1:{relay.sockets[0].getsockname()[1]}"
                    answer = await accuse(sybil_at, sybil, third.peer_id, b"\x02" * 64, SENDER_RUN.run_id)
                    assert answer.banned_peer == sybil.peer_id
            finally:
                for relay in relays:
                    relay.close()
            answer = await accuse(address, validator, liar.peer_id, true_evidence, SENDER_RUN.run_id)
            bans = {b.peer_id: b for b in await store.list_bans()}
            enforced = await store.enforced_bans(time.time(), grace_s=600)
            (false_accuser,) = await store._run(
                lambda db: db.execute(
                    "SELECT false_accuser FROM bans WHERE peer_id=?", (liar.peer_id,)
                ).fetchone()
            )
            return answer, bans[liar.peer_id], enforced, served.asked, bool(false_accuser)

    # Not pre-banned: the true evidence is replayed and convicts the liar, which heads the signed list.
    answer, ban, enforced, asked, false_accuser = asyncio.run(scenario(False, tmp_path / "control"))
    assert answer.banned_peer == liar.peer_id and "public batch seeds" in answer.verdict, answer
    assert ban.evidence_bytes == len(true_evidence) and enforced[0] == liar.peer_id and asked
    assert not false_accuser
    # Pre-banned as a false accuser: the same true evidence is judged and its conviction replaces that ban.
    answer, ban, enforced, asked, false_accuser = asyncio.run(scenario(True, tmp_path / "attack"))
    assert answer.banned_peer == liar.peer_id and "public batch seeds" in answer.verdict, answer
    assert asked and not false_accuser and ban.evidence_bytes == len(true_evidence)
    assert enforced[0] == liar.peer_id, "a conviction heads the list, before every self-banned Sybil"
