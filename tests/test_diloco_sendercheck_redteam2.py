"""A second attacker's read of the DiLoCo sender checks, after the fixes of 5aea0d3 (bf16 windows not
checked, every checked window exactly ``inner_steps``, one validator replay at a time within
``JUDGING_BUDGET_S``, the coordinator judging in a task that outlives the accuser's call). Each test
describes a way in that the read found (its docstring) and asserts what holds since it was closed
("Now:"); each failed on 5aea0d3.

In process, with the real model, dataset, codec, signatures, ``DilocoSync``, ``SenderChecks``,
``Averager._verify_later`` and the coordinator's service and store over gRPC on loopback. A window
replay at the coordinator (up to ``JUDGING_BUDGET_S``, 300 s, on its CPU) is the real replay of a 2-step
window after a sleep; durations keep the real ratios, scaled down: 1/100 against the accuser's retry
schedule (``ACCUSE_RETRY_DELAYS_S``, 15 + 30 + 60 s, becomes 1.05 s against a 3 s replay), and 5 times
the evidence read timeout (300 s against ``evidence_read_timeout_s`` 60 s becomes 10 s against 2 s).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hashlib
import time
import weakref
from types import SimpleNamespace

import grpc
import pytest
from helpers import ServedStates
from test_diloco_sendercheck_redteam import _live_window, _nonce

import swarm.coordinator_client as coordinator_client
import swarm.training.contribution as contribution
from coordinator.accusations import run_layouts
from coordinator.contributions import ContributionStates
from coordinator.limits import ServiceLimits
from coordinator.service import CoordinatorService
from coordinator.store import Store
from lab.localswarm import tiny_run
from protocols.errors import ProtocolError
from protocols.keys import SigningKey
from protocols.messages import JUDGING_BUDGET_S
from protocols.version import PROTOCOL_VERSION
from swarm.averaging.averager import Averager
from swarm.averaging.compression import get_codec
from swarm.averaging.evidence import (
    BadAggregateEvidence,
    SignedInput,
    chunk_bounds,
    contribution_message,
    draw_seed,
    drawn_validator,
    layout_chunk_values,
    round_digest,
    split_bounds,
)
from swarm.averaging.groups import GroupEntryBody, make_entry
from swarm.averaging.verification import assignments
from swarm.config import RunConfig, sender_checks_on, window_stretch
from swarm.coordinator_client import ACCUSE_RETRY_DELAYS_S, CoordinatorClient
from swarm.models import build_model
from swarm.rpc import CHANNEL_OPTIONS
from swarm.training.diloco import DilocoSync
from swarm.training.sendercheck import (
    MAX_PENDING,
    SenderChecks,
    StateCopy,
    WrongContributionEvidence,
    chunk_slice,
    drawn_sender,
    whole_micro_batches,
)
from swarm.training.state import DecodedState, build_optimizer, state_hash

SCALE = 0.01  # wall-clock durations of the scenarios below, against the real ones
REPLAY_S = JUDGING_BUDGET_S * SCALE  # one window replay at the coordinator, at most JUDGING_BUDGET_S

RUN = tiny_run(
    "diloco-redteam2", sync="diloco", inner_steps=2, compression="int8", verify_probability=1.0,
    sender_check_probability=1.0,
)  # fmt: skip
H = RUN.training.inner_steps
MICRO = RUN.training.micro_batch_size
WINDOW = float(H * MICRO)  # the samples of the run's whole window: the longest claim that is no lie


# --- helpers -------------------------------------------------------------------------------------------


def _drawn(
    run: RunConfig, keys, vector, *, sender: int, validator: int, hash_: str, tag: bytes, step: int = 0
) -> WrongContributionEvidence:
    """``sender``'s signed window (``vector``, the run's whole window of samples) in a round of ``keys``
    whose draw, from every member's reveal, names member ``validator`` to check one of its chunks and
    ``sender`` as the sender to replay there: evidence the coordinator's ``check_draw`` accepts."""
    prefix, codec, training = run.run_id.replace(".", "_"), get_codec(run.training.compression), run.training
    members = tuple(k.peer_id for k in keys)
    n = len(members)
    nonces = tuple(_nonce(i) for i in range(n))
    commits = tuple(hashlib.sha256(r).digest() for r in nonces)
    numel = run_layouts(run)[prefix]
    values = layout_chunk_values(n, codec.bytes_per_value)
    bounds = split_bounds(numel, n)
    chunks = [len(chunk_bounds(bounds[p + 1] - bounds[p], values)) - 1 for p in range(n)]
    others = [j for j in range(n) if j != validator]
    found = None
    for i in range(100_000):
        group_id = b"diloco-redteam2-" + tag + b"-%d" % i
        seed = draw_seed(round_digest(prefix, group_id, members, commits), nonces)
        for a in assignments(seed, n, validator, training.verify_probability, chunks):
            if (
                drawn_validator(seed, a.part, n) == validator
                and drawn_sender(seed, a.part, a.chunk, others, training.sender_check_probability) == sender
            ):
                found = (group_id, a.part, a.chunk)
                break
        if found:
            break
    assert found, "no group ID draws that"
    group_id, part, chunk = found
    digest = round_digest(prefix, group_id, members, commits)
    lo, hi = chunk_slice(numel, n, part, chunk, values)
    data = codec.encode_contribution(vector[lo:hi])
    signature = keys[sender].sign(contribution_message(digest, part, chunk, members[sender], WINDOW, data))
    body = GroupEntryBody(
        schema_hash=bytes(32),
        weight=WINDOW,
        commit=commits[sender],
        extra={"step": step, "state_hash": hash_},
    )
    return WrongContributionEvidence(
        prefix=prefix, group_id=group_id, members=members, commitments=commits, part=part, chunk=chunk,
        item=SignedInput(sender, data, signature, WINDOW), entry=make_entry(keys[sender], prefix, body),
        reveals=nonces,
    )  # fmt: skip


@contextlib.asynccontextmanager
async def _serving(tmp_path, run: RunConfig, states: ContributionStates, limits: ServiceLimits | None = None):
    """The real coordinator service and store, over gRPC on loopback: (address, store, service)."""
    store = Store.open_sync(tmp_path / "coordinator.db", run.run_id)
    service = CoordinatorService(run, SigningKey.generate(), store, [], limits, contribution_states=states)
    server = grpc.aio.server(options=CHANNEL_OPTIONS)
    server.add_generic_rpc_handlers((service.generic_handler(),))
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    try:
        yield address, store, service
    finally:
        await server.stop(grace=0.5)
        store.close()


async def _join(address: str, keys) -> None:
    async with CoordinatorClient(address) as client:
        for i, key in enumerate(keys):
            await client.join(key, RUN.run_id, name=f"p{i}-{key.peer_id[-6:]}", device="cpu")


def _window_of(peer_id: str):
    """(synced state at outer step 0, its hash, the honest window ``peer_id`` computes there)."""
    tensors, honest = _live_window(RUN, peer_id, H)
    return tensors, state_hash(0, tensors), honest


def _replays(monkeypatch, *, sleep_s: float) -> list[tuple[float, float, str]]:
    """Each coordinator replay of a window, (start, end, accused); each made to last ``sleep_s`` longer
    (a window replay on the coordinator's CPU takes up to JUDGING_BUDGET_S)."""
    seen: list[tuple[float, float, str]] = []
    real = WrongContributionEvidence.judge

    def judge(self, *args, **kwargs):
        started = time.monotonic()
        time.sleep(sleep_s)
        try:
            return real(self, *args, **kwargs)
        finally:
            seen.append((started, time.monotonic(), self.accused))

    monkeypatch.setattr(WrongContributionEvidence, "judge", judge)
    return seen


# --- 1. every accusation replays a whole window, one after another, even of a liar already banned ------


@pytest.mark.timeout(120)
def test_a_liar_already_banned_is_not_replayed_again_for_further_accusations(tmp_path, monkeypatch):
    """Now: an accusation against a banned peer is answered without a replay (checked again when a
    queued judgment's turn comes). Was MEDIUM (coordinator exhaustion; way in: be caught, or have Sybils accuse, more than once).
    ``coordinator/service.py:CoordinatorService._judge`` / ``coordinator/contributions.py:judge_contribution``
    replay the accused's whole window for every accusation, under the one ``_judging`` lock, with no check
    that the accused is already banned (or that this (accused, step) was already judged) and no deadline
    on the wait for the lock. Since 5aea0d3 a judgment is a task nobody cancels (before, the accuser's
    10 s call cut it off and the lock was let go), so each holds the lock for its whole replay, up to
    ``JUDGING_BUDGET_S``. A liar in a round of n members is replayed by up to n - 1 validators per round,
    and keeps lying every round until the first judgment ends: each of those accusations costs the
    coordinator another window replay (300 s at the budget), in series, and every other accusation of
    the run (a lying reducer's, judged in milliseconds otherwise) waits behind the queue. Here 3
    validators catch one liar; the first judgment bans it, and the two accusations filed after the ban
    still replay its window, one after the other. Suggested fix: before replaying, answer an accusation
    whose accused is already banned (or whose (accused, step, state) was already judged) without a replay
    and banning nobody; bound the queue (a judgment that waited past a deadline for the lock bans nobody)."""
    keys = [SigningKey.generate() for _ in range(4)]
    liar = keys[1].peer_id
    tensors, hash_, honest = _window_of(liar)
    lies = [
        _drawn(RUN, keys, -honest, sender=1, validator=v, hash_=hash_, tag=b"same-liar-%d" % v)
        for v in (0, 2, 3)
    ]
    replays = _replays(monkeypatch, sleep_s=0.5)

    async def scenario():
        async with _serving(tmp_path, RUN, ServedStates(DecodedState(0, tensors, {}, hash_))) as (
            address,
            store,
            _,
        ):
            await _join(address, keys)
            async with CoordinatorClient(address) as client:
                first = await client.accuse(
                    keys[0], RUN.run_id, accused=liar, reason="lie", evidence=lies[0].to_bytes()
                )
                assert first.banned_peer == liar and await store.ban_reason(liar) is not None
                later = await asyncio.gather(*(
                    client.accuse(keys[v], RUN.run_id, accused=liar, reason="lie", evidence=lie.to_bytes())
                    for v, lie in zip((2, 3), lies[1:], strict=True)
                ))  # fmt: skip
            return first, later

    first, later = asyncio.run(scenario())
    assert first.banned_peer == liar
    assert [r.banned_peer for r in later] == [liar, liar] and all(
        "already banned" in r.verdict for r in later
    )
    assert len(replays) == 1, "one replay: the later accusations find the liar banned"


@pytest.mark.timeout(120)
def test_a_queued_judgment_holds_no_downloaded_state(tmp_path, monkeypatch):
    """Now: the state is downloaded once the judgment's turn comes, so a queue of judgments holds one
    state at a time. Was MEDIUM (coordinator memory; way in: Sybil pairs, each accuser serving a state of its own making).
    Same root as the test above: ``coordinator/contributions.py:judge_contribution`` downloads the state
    before it waits for ``_judging`` (no deadline), and the queued judgment keeps it, a whole model and
    outer momentum (8 bytes a parameter), counted in no budget: the evidence budget sees only the
    evidence's few kilobytes. ``PeerContributionStates`` shares one download per (step, hash), so each
    Sybil pair names a state of its own (any tensors of the run's layout hash to something its accused
    signs). The queue is as long as the identities with an accusation in flight, each waiting up to
    ``JUDGING_BUDGET_S`` per judgment ahead of it; a task that nobody cancels now keeps all of it after
    its caller hangs up (before, a caller's deadline at least ended an honest caller's wait). Here 3
    pairs' judgments are queued at once, holding 3 states while the budget holds only their evidence.
    Suggested fix: download the state only once the lock is taken (and count it, or at most one, while
    waiting), and bound the queue with a deadline that bans nobody."""
    pairs = [[SigningKey.generate() for _ in range(3)] for _ in range(3)]
    base, _, window = _window_of(pairs[0][1].peer_id)
    states, lies = [], []
    for i, keys in enumerate(pairs):
        tensors = {k: v.clone() for k, v in base.items()}
        first = next(k for k, v in tensors.items() if v.is_floating_point())
        tensors[first] += 1e-3 * (i + 1)  # a state of its own
        hash_ = state_hash(0, tensors)
        states.append(DecodedState(0, tensors, {}, hash_))
        lies.append(_drawn(RUN, keys, window, sender=1, validator=0, hash_=hash_, tag=b"pair-%d" % i))
    held_states: list[weakref.ref] = []

    class _Downloaded(ServedStates):  # each download is a copy of its own, as bytes off the network are
        async def fetch(self, holder, step, state_hash):
            state = self.states.get(state_hash)
            tensors = {k: v.clone() for k, v in state.tensors.items()}
            held_states.append(weakref.ref(next(iter(tensors.values()))))
            return DecodedState(state.step, tensors, {}, state_hash)

    _replays(monkeypatch, sleep_s=1.0)

    async def scenario():
        async with _serving(tmp_path, RUN, _Downloaded(*states)) as (address, _store, service):
            await _join(address, [k for keys in pairs for k in keys])
            async with CoordinatorClient(address) as client:
                calls = [
                    asyncio.create_task(
                        client.accuse(
                            keys[0], RUN.run_id, accused=keys[1].peer_id, reason="x", evidence=lie.to_bytes()
                        )
                    )
                    for keys, lie in zip(pairs, lies, strict=True)
                ]
                most, queued = 0, 0
                while not all(c.done() for c in calls):
                    gc.collect()
                    most = max(most, sum(ref() is not None for ref in held_states))
                    queued = max(queued, len(service._judgments))
                    await asyncio.sleep(0.05)
                await asyncio.gather(*calls)
            return most, queued, len(held_states)

    most, queued, downloads = asyncio.run(scenario())
    assert queued == 3 and downloads == 3  # three judgments queued, each downloaded its state in turn
    assert most == 1, f"{most} states held at once"


# --- 3. an honest validator's next accusation is dropped while its first is being judged ---------------


@pytest.mark.timeout(120)
def test_an_honest_validators_next_accusation_is_taken_once_its_first_is_judged(tmp_path, monkeypatch):
    """Now: ``ACCUSE_RETRY_DELAYS_S`` spans more than a judgment (465 s against 300 s), so the second
    accusation is filed once the first is judged. Was MEDIUM (a proven liar unfiled; way in: any second lie a validator catches within one judgment).
    ``CoordinatorService.accuse`` keeps an accuser in ``_accusing`` until its judgment ends, which is now
    up to ``JUDGING_BUDGET_S`` (300 s) of replay plus the time queued behind other judgments, while
    ``swarm/coordinator_client.py:CoordinatorClient.accuse_until_taken`` retries an "in flight" refusal
    only for ``ACCUSE_RETRY_DELAYS_S`` (15 + 30 + 60 = 105 s) and then gives up (the caller only logs
    it). A DiLoCo validator files from one verification task per round; when it catches a second liar
    (another round's, while the coordinator still replays the first window, or the same round's sender
    after a reducer accusation whose call ran out) that accusation is lost for good. Before 5aea0d3 an
    accusation stayed in flight for the accuser's 10 s call at most. Scaled 1/100 here: the first
    judgment replays for 3 s, the retries span 1.05 s; the second liar is never banned. Suggested fix:
    let an accuser have a few accusations in flight (bounded by its bucket), or queue the second at
    the coordinator, or retry "in flight" for as long as ``JUDGING_BUDGET_S`` plus the queue."""
    assert sum(ACCUSE_RETRY_DELAYS_S) > JUDGING_BUDGET_S  # the real figures: 465 s against 300 s
    monkeypatch.setattr(
        coordinator_client, "ACCUSE_RETRY_DELAYS_S", tuple(d * SCALE for d in ACCUSE_RETRY_DELAYS_S)
    )
    validator = SigningKey.generate()
    first_round = [validator, SigningKey.generate(), SigningKey.generate()]
    second_round = [validator, SigningKey.generate(), SigningKey.generate()]
    liar1, liar2 = first_round[1].peer_id, second_round[1].peer_id
    tensors, hash_, window1 = _window_of(liar1)
    _, _, window2 = _window_of(liar2)
    lie1 = _drawn(RUN, first_round, -window1, sender=1, validator=0, hash_=hash_, tag=b"first")
    lie2 = _drawn(RUN, second_round, -window2, sender=1, validator=0, hash_=hash_, tag=b"second")
    _replays(monkeypatch, sleep_s=REPLAY_S)

    async def scenario():
        async with _serving(tmp_path, RUN, ServedStates(DecodedState(0, tensors, {}, hash_))) as (
            address,
            store,
            service,
        ):
            await _join(address, [*first_round, *second_round[1:]])
            async with CoordinatorClient(address) as client:
                first = asyncio.create_task(client.accuse_until_taken(
                    validator, RUN.run_id, accused=liar1, reason="lie", evidence=lie1.to_bytes()
                ))  # fmt: skip
                while not service._judging.locked():
                    await asyncio.sleep(0.02)
                second = await client.accuse_until_taken(
                    validator, RUN.run_id, accused=liar2, reason="lie", evidence=lie2.to_bytes()
                )
                assert second.banned_peer == liar2
                answer = await first
            return answer, await store.ban_reason(liar1), await store.ban_reason(liar2)

    answer, banned1, banned2 = asyncio.run(scenario())
    assert answer.banned_peer == liar1 and banned1 is not None
    assert banned2 is not None  # caught, proven, and filed once the first was judged


# --- 4. a round's sender check is lost while its reducer accusation waits on the coordinator ------------


@pytest.mark.timeout(120)
def test_a_rounds_sender_check_runs_while_its_reducer_accusation_waits(monkeypatch):
    """Now: a round's accusations are filed in tasks of their own (``Averager._file_later``), so its
    sender checks run at once, on the copy still kept. Was MEDIUM (a drawn liar never replayed; way in: a colluding reducer lies in the liar's round while
    the coordinator's judging lock is busy). ``swarm/averaging/averager.py:Averager._verify_later`` runs a
    round's reducer checks (``validate_round``, which awaits each accusation's verdict) before its sender
    checks (``SenderChecks.check``), and ``SenderChecks.keep`` holds the state copies of only the last
    ``MAX_PENDING`` (2) rounds. An accusation's call now lasts up to ``timeout_s + JUDGING_BUDGET_S``
    (310 s), then ``accuse_until_taken`` retries for 105 s more; a round whose validator accuses its
    reducer (a Sybil lying in its aggregate, or any reducer fault) waits that long, and once two more
    rounds have completed its state copy is gone: ``check`` finds no copy and replays nobody, so the
    drawn sender's lie in that round goes unchecked and unlogged. Before 5aea0d3 the call ended after
    10 s. The same flow with a prompt verdict replays and accuses the liar. Suggested fix: run the
    sender checks before (or beside) filing the round's accusations, file in the background, or pop the
    copy at the start of the verification task rather than after the accusations."""
    keys = [SigningKey.generate() for _ in range(3)]  # member 0 validates, 1 lies as sender, 2 reduces
    liar = keys[1].peer_id
    tensors, hash_, window = _window_of(liar)
    lie = _drawn(RUN, keys, -window, sender=1, validator=0, hash_=hash_, tag=b"evicted")
    codec = get_codec(RUN.training.compression)
    n, numel = len(keys), run_layouts(RUN)[lie.prefix]
    values = layout_chunk_values(n, codec.bytes_per_value)
    bounds = split_bounds(numel, n)
    part_chunks = [list(chunk_bounds(bounds[p + 1] - bounds[p], values)) for p in range(n)]
    entries = [lie.entry if i == 1 else b"" for i in range(n)]

    def runner(group_id: bytes, seed: bytes | None):
        return SimpleNamespace(
            group_id=group_id, members=list(lie.members), peer_ids=list(lie.members), index=0,
            shared_seed=seed, revealed=None, reveals=dict(enumerate(lie.reveals)), codec=codec, numel=numel,
            part_chunks=part_chunks, reducers=(), reduces=lambda part: False, round_timeout_s=1.0,
        )  # fmt: skip

    evidence = BadAggregateEvidence(
        prefix=lie.prefix, group_id=lie.group_id, members=lie.members, commitments=lie.commitments,
        part=lie.part, chunk=lie.chunk, numel=1, inputs=(lie.item,), output=b"", output_signature=b"",
        entries=b"", signed_at_ms=0,
    )  # fmt: skip

    def scenario(verdict_after_rounds: int) -> tuple[SenderChecks, list[str]]:
        accused: list[str] = []
        verdict = asyncio.Event()

        async def accuse(peer, filed, _why):  # the coordinator's answer (up to 310 s, then retries)
            if filed is evidence:  # the reducer's bad aggregate: its verdict comes late
                await verdict.wait()
            else:  # a sender check's evidence
                accused.append(peer)

        async def validate_round(runner, *, accuse, **_):  # the reducer check found its aggregate bad
            await accuse(keys[lie.part].peer_id, evidence, "a bad aggregate")
            return [SimpleNamespace(verdict="a bad aggregate", evidence=evidence)]

        monkeypatch.setattr("swarm.averaging.averager.validate_round", validate_round)
        checks = SenderChecks(RUN, device="cpu", state=lambda: (0, hash_, tensors), accuse=accuse)
        averager = SimpleNamespace(
            verify_probability=1.0, p2p=None, aggregator=None, codec=codec, accuse=accuse,
            policy=SimpleNamespace(suspect=lambda *a: None), sender_checks=checks, _verifications=set(),
        )  # fmt: skip
        averager._file_later = lambda *a: Averager._file_later(averager, *a)

        async def rounds():
            first = runner(lie.group_id, draw_seed(lie.digest, lie.reveals))
            await checks.keep(first, entries)
            Averager._verify_later(averager, first)  # its verification task: reducer checks, then senders
            for r in range(verdict_after_rounds):  # the next rounds complete meanwhile
                await asyncio.sleep(0.05)
                await checks.keep(runner(b"later-%d" % r, None), entries)
            verdict.set()
            await asyncio.gather(*averager._verifications)
            await checks.filed()

        asyncio.run(rounds())
        return checks, accused

    prompt, accused = scenario(verdict_after_rounds=0)
    assert prompt.checked == 1 and prompt.caught == 1 and liar in accused  # the control: replayed, filed
    late, accused = scenario(verdict_after_rounds=MAX_PENDING)
    assert late.checked == 1 and late.caught == 1 and liar in accused  # replayed and filed all the same


# --- 5. a checked window is exactly H: fast peers no longer wait for slower ones ----------------------


def test_in_a_checked_run_a_fast_peer_waits_for_the_others_at_H():
    """Now: a window held at H waits for the others (``DilocoSync.ready``) until every peer at the step
    claims a full window, or as long as the run's ``window_stretch`` would have let it train on (that
    share of its own window's time). Was MEDIUM (availability and honest work wasted; no attacker needed: any slower honest peer).
    ``swarm/config.py:window_stretch`` is 1 in every run whose windows are replayed (the diloco default
    with a dense codec in fp32), and ``swarm/training/diloco.py:DilocoSync.window_closed`` then closes a
    window at ``inner_steps`` without looking at the others' signed progress, so ``ready`` sends a fast
    peer into matchmaking at once. docs/diloco.md and docs/robustness.md say "a fast peer waits for the
    others", but nothing makes it: ``Averager.find_group``'s leader assembles as soon as its window
    (``matchmaking_time_s``, 2 s by default) opens with 2 members (hivemind ``Matchmaking``), so peers
    that finish an H-step window more than a matchmaking window after the fastest two are left out of
    the round; finding the run a step ahead they adopt its result (``TrainingPeer._adopt``), which
    drops their window without credit, and they start the next one as far behind, every outer step.
    Before (``window_stretch`` 2) the fast peers trained on until the slowest's signed record showed a
    full window, and everyone met in the same round. Shown here on the readiness rule itself; among
    real peers in the next test. Suggested fix: in a checked run keep the wait and drop the
    extra samples, i.e. close the window at H for the contribution but hold ``ready`` until every peer
    at the step claims a full window or ``window_stretch * H`` worth of time has passed, idling
    rather than training on."""
    assert (
        sender_checks_on(RUN) and window_stretch(RUN.training) == 1.0 and RUN.training.window_stretch == 2.0
    )

    def after_window(run: RunConfig) -> DilocoSync:
        model = build_model(run.model.name, run.model.config, seed=run.training.seed)
        strategy = DilocoSync(model, build_optimizer(model, run.optimizer), run)
        strategy.replica.inner = run.training.inner_steps  # its H inner steps are done
        return strategy

    slower = [MICRO, 0]  # two groupmates at the same outer step, a micro-batch or none into their windows
    checked = after_window(RUN)
    checked._started_at = time.monotonic() - 0.5  # its window took half a second
    assert not checked.wants_compute(int(WINDOW), slower)  # it trains no further than H
    assert not checked.ready(int(WINDOW), slower, fresh_view=True)  # it waits for them
    assert checked.ready(int(WINDOW), [int(WINDOW), int(WINDOW)], fresh_view=True)  # they are done: go
    time.sleep(0.6)  # as long as window_stretch 2 would have let it train on
    assert checked.ready(int(WINDOW), slower, fresh_view=True)  # no longer waits for them
    unchecked_run = RUN.model_copy(
        update={"training": RUN.training.model_copy(update={"sender_check_probability": 0.0})}
    )
    unchecked = after_window(unchecked_run)
    assert not unchecked.ready(int(WINDOW), slower, fresh_view=True) and unchecked.wants_compute(
        int(WINDOW), slower
    )


@pytest.mark.timeout(240)
def test_in_a_checked_run_a_slightly_slower_honest_peer_still_contributes():
    """Now: the slower peer's windows make the rounds (it contributes samples), checked or not. Was: the consequence of the test above among real peers (3 trainers, libp2p DHTs and rounds on
    loopback, ``tests/test_diloco.py``'s harness): one peer computes its micro-batches 1.4 times slower,
    so its 150-step window ends 1.2 s after the others', twice the 0.6 s matchmaking window. In the
    checked run (``window_stretch`` forced to 1) the two fast peers average without it at every outer
    step and it adopts their result: 0 samples contributed in 4 outer steps. The same run without sender
    checks (``window_stretch`` 2) holds every peer's window in every round. (On real windows of minutes,
    and the default 2 s matchmaking window, a peer a few percent slower than the fastest two is left out
    the same way.)

    The test sets the speeds, not the machine: each micro-batch is padded to 20 ms (28 ms for the slower
    peer), so the ratio holds whatever the load. The peers that go to their round on reading the last
    one's record are up to two progress exchanges apart (its publish, then their read), so records come
    every 0.1 s, well inside the matchmaking window. Before (0.3 s records, a 0.3 s window) a fast peer
    often read the slower one's record after the group the slower one led had formed, lost that round
    and, starting its next window late, the next one; missing two such groups, it contributed 0 samples
    in 4 outer steps (1 run in 7)."""
    import torch
    from helpers import KEYS, start_dhts
    from test_diloco import train

    from swarm.training.trainer import Trainer

    pace_ms, slower_pace_ms = 20, 28  # a micro-batch computes in about 3 ms here

    def paced(micro_step, seconds: float):
        def step() -> float:
            started = time.monotonic()
            loss = micro_step()
            time.sleep(max(0.0, seconds - (time.monotonic() - started)))
            return loss

        return step

    def contributed(checked: bool) -> list[int]:
        run = tiny_run(
            "diloco-redteam2-slow", sync="diloco", inner_steps=150, compression="int8", max_steps=4,
            matchmaking_time_s=0.6, progress_interval_s=0.1, sender_check_probability=0.5 if checked else 0.0,
        )  # fmt: skip
        training = run.training
        assert sender_checks_on(run) == checked and window_stretch(training) == (1.0 if checked else 2.0)
        late_s = training.inner_steps * (slower_pace_ms - pace_ms) / 1000  # its window ends after theirs
        assert late_s >= 2 * training.matchmaking_time_s  # a group formed without waiting leaves it out
        assert training.matchmaking_time_s > 5 * training.progress_interval_s  # the others read it in time
        assert slower_pace_ms / pace_ms < training.window_stretch  # they wait as long as their own window
        torch.set_num_threads(1)
        dhts = start_dhts(3)
        try:
            trainers = [
                Trainer(run, d, peer_id=d.peer_id.to_base58(), signing_key=KEYS[d.peer_id.to_base58()])
                for d in dhts
            ]
            for trainer, ms in zip(trainers, (pace_ms, pace_ms, slower_pace_ms), strict=True):
                trainer._micro_step = paced(trainer._micro_step, ms / 1000)
            asyncio.run(train(trainers, timeout_s=180))
            return [t.peer.contributed_samples for t in trainers]
        finally:
            for d in dhts:
                d.shutdown()

    fast1, fast2, slow = contributed(checked=True)
    assert fast1 > 0 and fast2 > 0 and slow > 0, (fast1, fast2, slow)


# --- 6. mixed versions: an honest window of the previous release is now a lie -------------------------


def test_a_peer_of_the_release_that_stretched_checked_windows_is_refused_by_its_protocol_version():
    """Now: ``PROTOCOL_VERSION`` is 5, so a version-4 peer (whose honest stretched window would be a lie
    here) is refused at join, not banned. Was LOW (honest peers banned in a mixed-version swarm; way in: none needed, a rolling upgrade).
    9d48485's ``DilocoSync.window_closed`` trained a fast peer on up to ``training.window_stretch`` (2)
    times ``inner_steps`` while slower peers finished, in checked runs too, and signed those samples;
    5aea0d3's ``swarm/training/sendercheck.py:whole_micro_batches`` (validators and coordinator) calls
    any claim past one window a lie, so every such honest old-release peer drawn for a replay is banned.
    The run config is unchanged (``window_stretch`` still reads 2.0) and ``PROTOCOL_VERSION`` stayed 4
    (as at 9d48485), so nothing refuses the old peer at join as the project does for other incompatible
    changes. The same holds for bf16 diloco runs the other way: an old validator replays a new peer's
    window from a fresh inner optimizer the new peer no longer uses there, and the new coordinator
    bans that validator as a false accuser ("does not recompute senders"). Suggested fix: bump
    ``PROTOCOL_VERSION`` with changes to what a valid contribution is."""
    assert PROTOCOL_VERSION >= 5 and RUN.training.window_stretch == 2.0
    model = build_model(RUN.model.name, RUN.model.config, seed=RUN.training.seed)
    old = DilocoSync(model, build_optimizer(model, RUN.optimizer), RUN)
    old.stretch = RUN.training.window_stretch  # 9d48485's rule: the config's window_stretch
    samples, slower = 0, [MICRO]
    while old.wants_compute(samples, slower):
        old.replica.inner += 1  # an inner step (its arithmetic does not matter to the claim)
        samples += MICRO
    assert samples == 2 * H * MICRO  # what the honest old peer signs for
    with pytest.raises(ProtocolError, match="a window ends after 2 inner steps"):
        whole_micro_batches(RUN, float(old.weight(samples)))


# --- 7. the skipped checks are predictable: a liar lies in the rounds its validators cannot replay -----


@pytest.mark.timeout(120)
def test_a_check_due_while_the_validator_replays_waits_its_turn(monkeypatch):
    """Now: one replay runs and one more waits its turn (``MAX_REPLAYS_DUE``), so a validator busy with
    last round's replay still replays this round's liar. Was LOW-MEDIUMLOW-MEDIUM (unchecked lies at will where checks are frequent; way in: read the previous round's
    public draw). ``swarm/training/sendercheck.py:SenderChecks._check_one`` now skips a check that comes
    due while the validator's previous replay runs. Which validators are replaying is public: every member
    learns round r-1's reveals, so the draw of who replays whom, before it signs its window for round r;
    and a window replay on a validator that trains meanwhile lasts about as long as a window or longer,
    so it is still running when round r's checks come due. A liar lies in just the rounds whose possible
    validators all drew a sender to replay in the round before (with every check on, about every other
    round) and is honest otherwise: its lies are never replayed, at no risk. Here V replays an honest
    sender drawn by round A's public reveals; in round B the draw names V to replay the liar, and V
    skips it; the same lie with V idle is caught. Suggested fix: do not skip by a public rule; defer the
    check (keep its copy, bounded, and replay it after the current one, or keep one pending check chosen
    by the validator's private coin) so that a sender cannot tell which rounds go unreplayed."""
    keys = [SigningKey.generate() for _ in range(3)]  # V validates; S is honest; L lies
    sender, liar = keys[1].peer_id, keys[2].peer_id
    tensors, hash_, s_window = _window_of(sender)
    _, _, l_window = _window_of(liar)
    round_a = _drawn(RUN, keys, s_window, sender=1, validator=0, hash_=hash_, tag=b"round-a")
    round_b = _drawn(RUN, keys, -l_window, sender=2, validator=0, hash_=hash_, tag=b"round-b")
    # What L reads from round A's reveals before it signs in round B: V was drawn to replay S.
    seed_a = draw_seed(round_a.digest, round_a.reveals)
    codec = get_codec(RUN.training.compression)
    numel = run_layouts(RUN)[round_a.prefix]
    values = layout_chunk_values(3, codec.bytes_per_value)
    bounds = split_bounds(numel, 3)
    chunks = [len(chunk_bounds(bounds[p + 1] - bounds[p], values)) - 1 for p in range(3)]
    drawn_for_v = [
        drawn_sender(seed_a, a.part, a.chunk, [1, 2], RUN.training.sender_check_probability)
        for a in assignments(seed_a, 3, 0, RUN.training.verify_probability, chunks)
    ]
    assert 1 in drawn_for_v  # V replays S's window after round A: L knows V is busy
    real = contribution.recompute

    def slow(*args, **kwargs):  # a window replay beside the validator's own training
        time.sleep(1.0)
        return real(*args, **kwargs)

    monkeypatch.setattr(contribution, "recompute", slow)

    def validator(busy: bool) -> tuple[SenderChecks, list[str]]:
        accused: list[str] = []

        async def accuse(peer, _evidence, _why):
            accused.append(peer)

        checks = SenderChecks(RUN, device="cpu", state=lambda: (0, hash_, tensors), accuse=accuse)

        def runner(lie):
            # Member 0 is the validator the round drew (``_evidence``).
            return SimpleNamespace(
                group_id=lie.group_id, codec=codec, numel=numel, members=list(lie.members), index=0
            )

        async def rounds():
            first = None
            if busy:
                first = asyncio.create_task(
                    checks._check_one(runner(round_a), round_a, StateCopy(0, hash_, tensors, {}))
                )
                await asyncio.sleep(0.2)
            await checks._check_one(runner(round_b), round_b, StateCopy(0, hash_, tensors, {}))
            if first is not None:
                await first
            await checks.filed()

        asyncio.run(rounds())
        return checks, accused

    idle, accused = validator(busy=False)
    assert idle.caught == 1 and accused == [liar]  # the control: the lie is replayed and filed
    busy, accused = validator(busy=True)
    assert busy.skipped == 0 and busy.caught == 1 and accused == [liar]  # waits its turn, then caught
