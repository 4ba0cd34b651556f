"""Regression tests for the red-team findings against ``unshown_input`` evidence and the coordinator's demand.

A security review showed nine ways to abuse the demand for a reducer's unshown inputs (an honest peer
banned, a lying reducer let go, an exception escaping the judge). Each test here plays the same attack
and asserts the outcome the fix gives; it fails if the defect comes back. The sixth finding is open
(documented in ``docs/protocol.md``): its test holds the archive to the bounds that limit it.

The coordinator's side is the real ``judge_unshown`` (and, where the wire matters, the real
``PeerRoundInputs`` talking to a reducer's real ``AveragingServicer`` handler, with its slots, admission and
``serve_inputs``, over an in-process socket pair instead of the libp2p daemon).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import os
import socket
import tempfile
import threading
import time
import tracemalloc
from collections import OrderedDict
from pathlib import Path
from types import SimpleNamespace
from typing import AsyncIterator  # noqa: UP035 - hivemind reads typing hints

import pytest
from hivemind.p2p import P2PContext, PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo
from hivemind.utils.multiaddr import Multiaddr
from test_evidence import (
    CODEC,
    PREFIX,
    RUN,
    SIGNED_AT_MS,
    VECTOR,
    ReducerAnswers,
    signed_round,
    unshown,
)
from test_input_archive import FinishedRound

from coordinator import roundinputs
from coordinator.roundinputs import PeerRoundInputs, RoundInputs, judge_unshown
from coordinator.service import CoordinatorService
from coordinator.store import PeerRecord, Store
from protocols import averaging_pb2 as apb
from protocols.codec import pack
from protocols.envelope import MAX_CLOCK_SKEW_S
from protocols.errors import ProtocolError
from protocols.keys import PublicKey, SigningKey
from swarm.averaging.allreduce import ButterflyAllReduce
from swarm.averaging.archive import KEEP_INPUTS_S, MAX_KEPT_INPUT_BYTES, InputArchive
from swarm.averaging.averager import AveragingServicer
from swarm.averaging.evidence import (
    INPUT_DEMAND_WINDOW_S,
    NONCE_BYTES,
    BadAggregateEvidence,
    SignedInput,
    UnshownInputEvidence,
    draw_seed,
    drawn_validator,
    parse_entries,
    parse_evidence,
)
from swarm.averaging.policy import PeerPolicy
from swarm.averaging.reducer import check_reveal
from swarm.averaging.rounds import RoundRegistry
from swarm.averaging.sender import check_answer
from swarm.averaging.transport import MAX_CONNECTIONS_PER_PEER
from swarm.averaging.verification import Outcome, _unshown
from swarm.config import RunConfig
from swarm.inbound import MAX_STREAMS

pytestmark = pytest.mark.timeout(60)

RUN_CONFIG = RunConfig(
    run_id=RUN, model={"name": "gpt", "config": {"d_model": 32, "n_layer": 1}},
    training={"compression": "fp16", "aggregator": "centered_clip"},
)  # fmt: skip
LAYOUTS = {PREFIX: VECTOR}
SIGNED_S = SIGNED_AT_MS / 1000
JOINED_S = SIGNED_S - 3600.0  # the accused's current session joined an hour before it signed


@pytest.fixture(scope="module")
def keys() -> list[SigningKey]:
    return [SigningKey.generate() for _ in range(3)]


# --- helpers ---------------------------------------------------------------------------------------------


def round_with(
    keys: list[SigningKey], *, nonces: list[bytes], signed_at_ms: int, shift: float = 0.0, part: int = 0
) -> BadAggregateEvidence:
    """``test_evidence.signed_round`` with the members' nonces and the reducer's signed time chosen."""
    return signed_round(
        keys,
        part=part,
        shift=shift,
        nonces=nonces,
        signed_at_ms=signed_at_ms,
        group_id=b"group-redteam",
        seed=2,
    )


def as_unshown(
    full: BadAggregateEvidence, nonces: list[bytes], missing: tuple[int, ...]
) -> UnshownInputEvidence:
    fields = {f: getattr(full, f) for f in BadAggregateEvidence.__dataclass_fields__}
    shown = tuple(i for i in full.inputs if i.sender_index not in missing)
    return UnshownInputEvidence(**{**fields, "inputs": shown}, missing=missing, reveals=tuple(nonces))


def drawn_accuser(evidence: UnshownInputEvidence) -> str:
    return evidence.members[drawn_validator(draw_seed(evidence.digest, evidence.reveals), evidence.part, 3)]


async def judged(evidence, accuser, inputs, *, joined=JOINED_S, now_s=SIGNED_S + 10.0, accused=None):
    """``judge_unshown`` of ``evidence``; ``joined`` is what ``joined_at`` answers for the accused (a time,
    None when it is not online, or a coroutine function asked like the coordinator's ``_joined_at``)."""

    async def joined_at(peer_id):
        return await joined(peer_id) if callable(joined) else joined

    return await judge_unshown(
        RUN_CONFIG, lambda: LAYOUTS, evidence.to_bytes(), accused or evidence.accused, accuser,
        inputs=inputs, joined_at=joined_at, judging=asyncio.Lock(), now=lambda: now_s,
    )  # fmt: skip


def service_joined_at(store: Store, clock_offsets: dict[str, float], sessions: dict[str, float]):
    """The coordinator's real ``_joined_at`` over ``store``, each peer's clock offset as its heartbeats
    showed, and the sessions ``sessions`` (peer -> when it joined, by the coordinator's clock; a dict the
    caller may add a rejoin to, as ``CoordinatorService.join`` does)."""
    service = SimpleNamespace(store=store, _clock_offsets=OrderedDict(), _sessions=sessions, _started_at=0.0)
    for peer, offset_s in clock_offsets.items():
        CoordinatorService._note_clock(service, peer, offset_s)
    return lambda peer: CoordinatorService._joined_at(service, peer)


class ArchiveAnswers(RoundInputs):
    """The reducer's real ``serve_inputs`` over its archive (its round gone from the registry), asked by
    the coordinator: what ``rpc_round_inputs`` answers it, short of the wire."""

    can_ask = True

    def __init__(self, archive: InputArchive, coordinator: str):
        self.archive, self.coordinator = archive, coordinator

    async def fetch(self, evidence, sender_index):
        from swarm.averaging.verification import serve_inputs

        request = apb.InputsRequest(
            group_id=evidence.group_id, part_index=evidence.part, chunk_index=evidence.chunk,
            sender_index=sender_index,
        )  # fmt: skip
        async for item in serve_inputs(
            None, request, PeerID.from_base58(self.coordinator), judge=self.coordinator, archive=self.archive
        ):
            if item.code != apb.OK:
                return None
            return SignedInput(item.sender_index, item.data, item.signature, item.weight)
        return None


# --- an in-process libp2p stand-in: the real servicer's stream handlers over socket pairs ----------------


class Node:
    """A peer's P2P as far as ``BoundedServicer.add_p2p_handlers`` and ``call_bounded`` use it."""

    def __init__(self, peer_id: str, network: dict[str, Node]):
        self.peer_id, self.network = PeerID.from_base58(peer_id), network
        self.handlers: dict = {}
        self.tasks: set[asyncio.Task] = set()
        self.writers: list = []
        network[peer_id] = self

    # By method name: a servicer subclass (an attacker's handler) registers under its own class name.
    async def add_binary_stream_handler(self, name, handler, balanced=False):
        self.handlers[name.rsplit(".", 1)[-1]] = handler

    async def add_protobuf_handler(self, name, handler, input_type, balanced=False):
        self.handlers[name.rsplit(".", 1)[-1]] = handler

    async def call_binary_stream_handler(self, peer: PeerID, name: str):
        target = self.network[peer.to_base58()]
        mine, theirs = socket.socketpair()
        server_reader, server_writer = await asyncio.open_connection(sock=theirs)
        reader, writer = await asyncio.open_connection(sock=mine)
        info = StreamInfo(self.peer_id, Multiaddr("/ip4/127.0.0.1/tcp/1"), name)
        task = asyncio.create_task(
            target.handlers[name.rsplit(".", 1)[-1]](info, server_reader, server_writer)
        )
        target.tasks.add(task)
        self.writers.append(writer)
        return info, reader, writer

    async def close(self):
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for writer in self.writers:
            writer.close()


async def reducer_node(
    network,
    reducer: str,
    coordinator: str,
    archive: InputArchive,
    *,
    certified=(),
    servicer=AveragingServicer,
) -> Node:
    """A reducer's averaging handlers (a restarted one: its registry is empty) on the stand-in network."""
    node = Node(reducer, network)
    averager = SimpleNamespace(
        rounds=RoundRegistry(), archive=archive, matchmaking_time_s=1.0, max_frame=1 << 20,
        policy=PeerPolicy(
            None, RUN, PublicKey.from_peer_id(coordinator), also_certified=lambda: set(certified)
        ),
    )  # fmt: skip
    await servicer(averager).add_p2p_handlers(node, namespace=PREFIX)
    return node


def kept(full: BadAggregateEvidence) -> FinishedRound:
    return FinishedRound(full.group_id, list(full.members), {(full.part, full.chunk): list(full.inputs)})


def filled_round(group_id: bytes, members, nbytes: int) -> FinishedRound:
    """A finished round whose kept inputs (data and signatures) come to exactly ``nbytes``; the full-size
    inputs share one buffer, so only the archive's byte count is large."""
    block, signature = bytes(8 << 20), bytes(64)
    full = (nbytes - len(signature)) // (len(block) + len(signature))
    datas = [block] * full + [bytes(nbytes - full * (len(block) + len(signature)) - len(signature))]
    held: dict = {}
    for j, data in enumerate(datas):
        held.setdefault((0, j // 3), []).append(SignedInput(j % 3, data, signature, 8.0))
    return FinishedRound(group_id, list(members), held)


# --- 1. a lying reducer backdates its aggregate to walk out of the demand window ----------------------------


def test_a_backdated_aggregate_still_leaves_time_to_demand_its_inputs(keys):
    """A lying reducer dates its aggregate in the past to escape ``unshown_input``.

    Members accept a signed time up to ``MAX_CLOCK_SKEW_S`` (120 s) off their clock
    (``sender.py:check_answer``), so a reducer may sign ``signed_at_ms = now - 119 s`` and every member
    still takes it. The coordinator now demands inputs for ``INPUT_DEMAND_WINDOW_S`` (600 s) after the
    signed time, and an honest reducer archives them for ``KEEP_INPUTS_S`` (900 s): the backdating buys
    the liar nothing. Its aggregate is shifted and it shows nothing; judged 10 s after the real signing,
    and again as late as the window allows (about eight minutes later), it is convicted.
    """
    now_ms = int(time.time() * 1000)
    nonces = [os.urandom(NONCE_BYTES) for _ in keys]
    backdated_ms = now_ms - int((MAX_CLOCK_SKEW_S - 1) * 1000)
    lying = round_with(keys, nonces=nonces, signed_at_ms=backdated_ms, shift=0.5)
    # Member 1 checks the aggregate it got back, as ``sender.check_answer`` does: it passes.
    member = SimpleNamespace(
        members=list(lying.members), key=keys[1], digest=lying.digest, index=1, weight=8.0
    )
    answer = apb.PartChunk(
        part_index=0, chunk_index=0, data=lying.output, signature=lying.output_signature,
        included=lying.entries, signed_at_ms=lying.signed_at_ms,
    )  # fmt: skip
    check_answer(member, 0, 0, answer, hashlib.sha256(lying.inputs[1].data).digest())

    evidence = as_unshown(lying, nonces, missing=(0,))
    accuser = drawn_accuser(evidence)
    latest_s = INPUT_DEMAND_WINDOW_S - MAX_CLOCK_SKEW_S - 1  # after the real signing
    assert latest_s >= 5 * 60, "the validator has minutes to wait out the reveals, collect and file"
    for delay_s in (10.0, latest_s):
        answers = ReducerAnswers(None)
        found, guilty = asyncio.run(
            judged(evidence, accuser, answers, joined=now_ms / 1000 - 3600, now_s=now_ms / 1000 + delay_s)
        )
        assert guilty == keys[0].peer_id and "did not show the coordinator" in found, (delay_s, found)
        assert answers.asked == [0]
    # An honest reducer still holds the inputs whenever the coordinator may demand them.
    assert KEEP_INPUTS_S >= INPUT_DEMAND_WINDOW_S + 2 * MAX_CLOCK_SKEW_S


# --- 2. a reducer commits to a long nonce so that its honest validator's evidence bans the validator -------


def validator_files(keys, lying: BadAggregateEvidence, nonces: list[bytes], validator: int):
    """The drawn ``validator``, as the reducer of its own part, takes every other member's reveal
    (``reducer.check_reveal``, into the round's shared ``reveals``); then, unable to collect the
    reducer's own input of part 0, it files through ``_unshown`` as ``check_reducer`` does. Returns its
    outcome and the reveals it refused (sender index -> why)."""
    commits = list(lying.commitments)
    reducer_view = SimpleNamespace(
        index=validator,
        chunk_count=lambda part: 1,
        commitments=commits,
        reveals={validator: nonces[validator]},
    )
    refused = {}
    for sender, nonce in enumerate(nonces):
        if sender != validator:
            reveal = apb.PartChunk(part_index=validator, chunk_index=1, reveal=nonce)
            try:
                check_reveal(reducer_view, sender, reveal)
            except ProtocolError as e:
                refused[sender] = str(e)
    runner = SimpleNamespace(
        members=list(lying.members), digest=lying.digest, commitments=commits, reveals=reducer_view.reveals,
        numel=VECTOR, index=validator, chunk_values=None,
    )  # fmt: skip
    runner.shared_seed = ButterflyAllReduce.shared_seed.fget(runner)
    check = SimpleNamespace(
        round=dict(prefix=PREFIX, group_id=lying.group_id, members=lying.members, commitments=lying.commitments,
                   part=0, chunk=0, reducers=(), signer=None),
        numel=lying.numel, part=0, chunk=0, codec=CODEC,
    )  # fmt: skip
    answer = apb.PartChunk(
        part_index=0, chunk_index=0, data=lying.output, signature=lying.output_signature,
        included=lying.entries, signed_at_ms=lying.signed_at_ms,
    )  # fmt: skip
    found = [None, *lying.inputs[1:]]
    return _unshown(runner, check, answer, parse_entries(lying.entries, 3), found, Outcome()), refused


def test_a_long_nonce_is_refused_at_its_reveal_and_the_honest_validator_files_nothing_that_bans_it(keys):
    """A lying reducer commits to a 100-byte nonce, lies, and shows nothing, so that the evidence its
    honest validator files carries a reveal the coordinator refuses, which would ban the validator.

    Reveals are now exactly ``NONCE_BYTES`` (32): ``reducer.check_reveal`` refuses any other length
    even when its SHA-256 matches the commitment, just as the coordinator's parser refuses such evidence.
    The validator never takes the long reveal, so the round has no shared draw and it files nothing;
    it is not banned. With honest 32-byte nonces the same lie is filed, and the coordinator convicts the
    reducer, not the validator.
    """
    nonces = [os.urandom(100), os.urandom(NONCE_BYTES), os.urandom(NONCE_BYTES)]  # the reducer of part 0 lies
    lying = round_with(keys, nonces=nonces, signed_at_ms=SIGNED_AT_MS, shift=0.5)
    validator = drawn_validator(draw_seed(lying.digest, nonces), 0, 3)
    outcome, refused = validator_files(keys, lying, nonces, validator)
    assert list(refused) == [0] and f"revealed a nonce of 100 bytes, not {NONCE_BYTES}" in refused[0]
    assert outcome.evidence is None and outcome.verdict is None, "the validator files nothing"
    # The coordinator refuses reveals of any other length too: reducer and judge agree.
    with pytest.raises(ProtocolError, match=f"nonces of {NONCE_BYTES} bytes"):
        parse_evidence(as_unshown(lying, nonces, (0,)).to_bytes())

    # Control: the same lie with honest nonces is filed, and convicts the reducer.
    nonces = [os.urandom(NONCE_BYTES) for _ in keys]
    lying = round_with(keys, nonces=nonces, signed_at_ms=SIGNED_AT_MS, shift=0.5)
    validator = drawn_validator(draw_seed(lying.digest, nonces), 0, 3)
    outcome, refused = validator_files(keys, lying, nonces, validator)
    assert refused == {} and isinstance(outcome.evidence, UnshownInputEvidence)
    answers = ReducerAnswers(None)
    found, guilty = asyncio.run(judged(outcome.evidence, lying.members[validator], answers))
    assert guilty == keys[0].peer_id and "did not show the coordinator" in found
    assert answers.asked == [0]


# --- 3. an honest reducer that restarted after signing is asked for the archive it lost --------------------


def test_an_honest_reducer_that_restarted_after_signing_is_not_banned(keys):
    """An honest reducer restarts (crash, upgrade, preemption) after it signed an aggregate; its
    ``InputArchive`` lived in memory only, so a validator that checks (or files at the right moment) while
    it is down gets nothing, and the coordinator's demand gets NO_EVIDENCE from the restarted handler.

    ``judge_unshown`` now reads ``joined_at`` (when the accused's current session joined, by its own
    clock) before the demand, and bans nobody when that session joined after it signed, less
    ``JOIN_MARGIN_S``. The coordinator's real ``_joined_at`` over its real ``Store`` is asked: before the
    restart the demand is answered from the archive; after the restart and its join, nobody is banned.
    """
    honest = signed_round(keys)
    evidence = unshown(honest, (0,))
    accuser = drawn_accuser(evidence)
    coordinator = SigningKey.generate().peer_id
    reducer = keys[0].peer_id
    record = PeerRecord(reducer, b"", "r", "cpu", "data", "online", JOINED_S, JOINED_S, 0, 1, 1e12)
    # The rule itself: a session that joined after the signing lost what it held.
    found, guilty = asyncio.run(judged(evidence, accuser, ReducerAnswers(None), joined=SIGNED_S + 5.0))
    assert guilty is None and "joined again after it signed" in found

    async def scenario(tmp):
        store = Store.open_sync(tmp / "store.db", RUN)
        try:
            await store.admit(record)
            sessions = {reducer: JOINED_S}
            joined_at = service_joined_at(store, {reducer: 0.0}, sessions)  # its clock agrees with ours
            verdicts = []
            for archive in (InputArchive(), InputArchive()):  # before the restart, and after it
                if not verdicts:
                    archive.keep(kept(honest))
                else:  # it restarted 5 s after signing and joined again, as ``CoordinatorService.join`` admits
                    await store.admit(
                        dataclasses.replace(record, joined_at=SIGNED_S + 5.0, last_seen=SIGNED_S + 5.0)
                    )
                    sessions[reducer] = SIGNED_S + 5.0
                network: dict[str, Node] = {}
                node = await reducer_node(network, reducer, coordinator, archive)
                asker = Node(coordinator, network)
                try:
                    verdicts.append(
                        await judged(evidence, accuser, PeerRoundInputs(asker, 2.0), joined=joined_at)
                    )
                finally:
                    await node.close()
                    await asker.close()
            return verdicts
        finally:
            store.close()

    with tempfile.TemporaryDirectory() as tmp:
        before, after = asyncio.run(scenario(Path(tmp)))
    assert before[1] is None and "showed the coordinator every input" in before[0]
    assert after[1] is None and "joined again after it signed" in after[0], f"the restarted reducer: {after}"


# --- 4. certified sybils fill the reducer's rpc_round_inputs slots while the coordinator asks ----------------


def test_silent_streams_from_certified_peers_leave_the_coordinators_demand_answered(keys):
    """Framing by slot exhaustion: certified identities hold every ``rpc_round_inputs`` slot with silent
    streams, timed with their own accusation, so that the coordinator's demand is refused and the honest
    reducer, which holds the input, looks as if it would not show it.

    ``rpc_round_inputs`` takes ``MAX_STREAMS`` (256) streams at once, ``MAX_CONNECTIONS_PER_PEER`` (8) per
    caller, and a certified peer's stream holds its slot ``FIRST_REQUEST_TIMEOUT_S`` (10 s) before sending
    anything. ``AveragingServicer.exempt`` now lets the coordinator's peer ID (``policy.judge``) past the
    stream caps and admission: with all 256 slots held, a member of the round is refused, but the
    coordinator's demand is answered and nobody is banned.
    """
    honest = signed_round(keys)
    evidence = unshown(honest, (0,))
    accuser = drawn_accuser(evidence)
    coordinator = SigningKey.generate().peer_id
    member = keys[1].peer_id  # a member of the round, certified like the sybils
    sybils = [SigningKey.generate().peer_id for _ in range(MAX_STREAMS // MAX_CONNECTIONS_PER_PEER)]

    async def scenario():
        results = []
        for flood in (False, True):
            archive = InputArchive()
            archive.keep(kept(honest))  # the honest reducer holds the input
            network: dict[str, Node] = {}
            node = await reducer_node(
                network, keys[0].peer_id, coordinator, archive, certified=[*sybils, member]
            )
            callers = [Node(coordinator, network), Node(member, network)] + [Node(s, network) for s in sybils]
            try:
                if flood:
                    name = AveragingServicer._get_handle_name(PREFIX, "rpc_round_inputs")
                    for sybil in callers[2:]:
                        for _ in range(MAX_CONNECTIONS_PER_PEER):
                            await sybil.call_binary_stream_handler(node.peer_id, name)
                    await asyncio.sleep(0.3)  # their handlers have taken their slots and wait for a request
                member_got = await PeerRoundInputs(callers[1], 2.0).fetch(evidence, 0)
                verdict = await judged(evidence, accuser, PeerRoundInputs(callers[0], 2.0))
                results.append((member_got, verdict))
            finally:
                await node.close()
                for caller in callers:
                    await caller.close()
        return results

    (calm_member, calm), (flooded_member, flooded) = asyncio.run(scenario())
    assert calm_member is not None and calm[1] is None and "showed the coordinator every input" in calm[0]
    assert flooded_member is None, "every slot is held: a member of the round is refused"
    assert flooded[1] is None and "showed the coordinator every input" in flooded[0], flooded


# --- 5. a lying reducer leaves the run when the demand comes -------------------------------------------------


class LeavingReducer(AveragingServicer):
    """A lying reducer's handler: when the coordinator demands an input, it leaves the run (a signed
    Leave, here its effect on the store) and shows nothing."""

    store: Store
    reducer: str

    async def rpc_round_inputs(
        self, request: apb.InputsRequest, context: P2PContext
    ) -> AsyncIterator[apb.SignedInput]:
        if context.remote_id.to_base58() == self.averager.policy.judge:
            await self.store.record_leave(self.reducer, seq=1, seen_at=time.time())
        yield apb.SignedInput(code=apb.NO_EVIDENCE, error="holds nothing")


def test_a_lying_reducer_that_leaves_when_asked_is_still_convicted(keys):
    """The demand comes from the coordinator's peer ID, so a lying reducer knows it is being judged: it
    sends a Leave (state 'left') and answers nothing, hoping to be found not online and let go.

    ``judge_unshown`` now reads ``joined_at`` (the coordinator's real ``_joined_at`` over its real
    ``Store``) when the evidence arrives, before it asks: the reducer was online then, so leaving once
    asked saves nothing. It is convicted for the input it did not show, although the store shows it left.
    """
    lying = signed_round(keys, shift=0.5)
    evidence = unshown(lying, (0,))
    accuser = drawn_accuser(evidence)
    coordinator = SigningKey.generate().peer_id
    reducer = keys[0].peer_id
    record = PeerRecord(reducer, b"", "r", "cpu", "data", "online", JOINED_S, JOINED_S, 0, 1, 1e12)

    async def scenario(tmp):
        store = Store.open_sync(tmp / "store.db", RUN)
        try:
            await store.admit(record)
            LeavingReducer.store, LeavingReducer.reducer = store, reducer
            joined_at = service_joined_at(store, {reducer: 0.0}, {reducer: JOINED_S})
            network: dict[str, Node] = {}
            node = await reducer_node(network, reducer, coordinator, InputArchive(), servicer=LeavingReducer)
            asker = Node(coordinator, network)
            try:
                verdict = await judged(evidence, accuser, PeerRoundInputs(asker, 2.0), joined=joined_at)
            finally:
                await node.close()
                await asker.close()
            return verdict, await store.get_peer(reducer)
        finally:
            store.close()

    with tempfile.TemporaryDirectory() as tmp:
        (found, guilty), after = asyncio.run(scenario(Path(tmp)))
    assert after.state == "left", "it did leave while it was asked"
    assert guilty == reducer and "did not show the coordinator" in found, found


# --- 6. withheld reveals push an honest reducer's archive out, or keep it from being written ---------------


def test_the_input_archive_stays_within_its_byte_bound_and_evicts_the_oldest_round_first(keys):
    """OPEN (documented in docs/protocol.md, ``PartChunk.signed_at_ms``): a colluder that withholds its
    reveal from an honest reducer leaves the round's draw incomplete there, so the reducer archives every
    chunk of its part (``allreduce.py:_trim`` returns early), about the whole model's wire size. Such a
    round evicts older rounds from the ``InputArchive`` (oldest first) or, above ``MAX_KEPT_INPUT_BYTES``
    (256 MiB), is not archived at all; a colluding drawn validator that files once the round has also left
    the registry could then have the honest reducer convicted.

    Not fixed; this test holds the archive to the bounds that limit the attack: while its round is
    archived the honest reducer answers the demand and nobody is banned; a round over the bound is not
    archived and evicts nothing; one that fits evicts only as many of the oldest rounds as it needs, and
    the archive never holds more than ``max_bytes``. (The big rounds' inputs share one buffer, so only the
    archive's byte count is large.)
    """
    honest = signed_round(keys)
    evidence = unshown(honest, (1,))
    accuser = drawn_accuser(evidence)
    coordinator = SigningKey.generate().peer_id
    archive = InputArchive()
    assert archive.max_bytes == MAX_KEPT_INPUT_BYTES
    archive.keep(kept(honest))
    found, guilty = asyncio.run(judged(evidence, accuser, ArchiveAnswers(archive, coordinator)))
    assert guilty is None and "showed the coordinator every input" in found
    newer = FinishedRound(b"group-newer", list(honest.members), {(0, 0): list(honest.inputs)})
    archive.keep(newer)
    newer_bytes = sum(len(i.data) + len(i.signature) for i in honest.inputs)
    assert archive.nbytes == 2 * newer_bytes

    # A round whose inputs alone exceed the bound (a colluder withheld its reveal) is not archived.
    oversized = filled_round(b"group-oversized", honest.members, MAX_KEPT_INPUT_BYTES + 1)
    archive.keep(oversized)
    assert archive.lookup(oversized.group_id, 0, 0, 0) is None
    assert archive.nbytes == 2 * newer_bytes, "and it evicts nothing"
    assert archive.lookup(honest.group_id, 0, 0, 1) is not None

    # One that just fits beside the newer round evicts the oldest round only.
    withheld = filled_round(b"group-withheld", honest.members, MAX_KEPT_INPUT_BYTES - newer_bytes)
    archive.keep(withheld)
    assert archive.nbytes == MAX_KEPT_INPUT_BYTES <= archive.max_bytes
    assert archive.lookup(withheld.group_id, 0, 0, 0) is not None
    assert archive.lookup(newer.group_id, 0, 0, 1) is not None
    assert archive.lookup(honest.group_id, 0, 0, 1) is None, "the oldest round went first"
    assert list(archive.rounds) == [newer.group_id, withheld.group_id]


# --- 7. malformed evidence: an integer where bytes belong ---------------------------------------------------


def test_an_integer_where_bytes_belong_convicts_the_accuser_without_allocating_it(keys):
    """An accuser puts integers where the evidence holds bytes. ``bytes(n)`` of an int is a size: ``2**63``
    raised OverflowError out of the judge (the accuser never judged), and a moderate int made the
    coordinator allocate and copy that many bytes on the judging thread for a 200-byte accusation.

    Evidence parsing now type-checks every bytes field (``evidence.py:bytes_field``, with a size bound) and
    every input's index, and ``judge_unshown`` catches whatever the evidence raises: each forgery finds
    the accuser guilty ("the evidence does not hold"), and no large allocation happens.
    """
    body = unshown(signed_round(keys), (0,))._body()
    accuser = drawn_accuser(unshown(signed_round(keys), (0,)))

    async def judge_raw(data):
        return await judge_unshown(
            RUN_CONFIG, lambda: LAYOUTS, data, keys[0].peer_id, accuser, inputs=ReducerAnswers(None),
            joined_at=lambda p: asyncio.sleep(0, JOINED_S), judging=asyncio.Lock(), now=lambda: SIGNED_S,
        )  # fmt: skip

    size = 32 << 20
    forgeries = {
        "commitment": {**body, "commitments": [2**63, *body["commitments"][1:]]},
        "input data": {**body, "inputs": [[1, 2**63, b"", 8.0]]},
        "input index": {**body, "inputs": [[2**63, b"", b"", 8.0]]},
        "output": {**body, "output": 2**62},
        "group ID": {**body, "group_id": size, "inputs": []},
    }
    tracemalloc.start()
    try:
        for what, forged in forgeries.items():
            data = pack(forged)
            assert len(data) < 8192  # a few KiB: the inputs, the reducer's output, signature and entries
            found, guilty = asyncio.run(judge_raw(data))
            assert guilty == accuser and found.startswith("the evidence does not hold"), (what, found)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, f"the judge allocated {peak} bytes for a forged size of {size}"


# --- 8. a colluding reducer that answers slowly keeps an accusation (and its evidence bytes) open ----------


class SlowReducer(AveragingServicer):
    """A colluding reducer: it lets the first try of each demand time out and answers the next one, or,
    with ``stall``, never answers. It counts the demands it holds at once."""

    seen: set
    stall: bool
    in_flight: int
    most_in_flight: int

    async def rpc_round_inputs(
        self, request: apb.InputsRequest, context: P2PContext
    ) -> AsyncIterator[apb.SignedInput]:
        cls = type(self)
        cls.in_flight += 1
        cls.most_in_flight = max(cls.most_in_flight, cls.in_flight)
        try:
            if cls.stall or request.sender_index not in cls.seen:
                cls.seen.add(request.sender_index)
                await asyncio.sleep(3600)
        finally:
            cls.in_flight -= 1
        async for item in super().rpc_round_inputs(request, context):
            yield item


def test_slow_answers_are_asked_together_and_the_demand_ends_at_its_deadline(keys, monkeypatch):
    """A colluding reducer lets every first try of the demand time out and answers the second, while a
    colluding validator lists every input as missing: asked one after another, each costing a timeout,
    one accusation stayed open (and held its evidence bytes and the judging) for hours.

    ``judge_unshown`` now asks for every missing input at once (up to ``DEMAND_CONCURRENCY``, 8) under one
    overall deadline, ``DEMAND_DEADLINE_S`` (60 s), and an input not shown by then counts as not shown.
    Scaled: with 1.5 s a try, the three slow answers are all held at once and the honest (if slow)
    reducer is cleared in about one timeout, not three; with the deadline set to 1 s and tries of 30 s,
    a reducer that never answers is convicted at the deadline.
    """
    honest = signed_round(keys)
    evidence = dataclasses.replace(unshown(honest, (0, 1, 2)), inputs=())
    accuser = drawn_accuser(evidence)
    coordinator = SigningKey.generate().peer_id
    assert len(evidence.missing) <= roundinputs.DEMAND_CONCURRENCY

    async def scenario(stall: bool, timeout_s: float):
        archive = InputArchive()
        archive.keep(kept(honest))
        SlowReducer.seen, SlowReducer.stall, SlowReducer.in_flight, SlowReducer.most_in_flight = (
            set(),
            stall,
            0,
            0,
        )
        network: dict[str, Node] = {}
        node = await reducer_node(network, keys[0].peer_id, coordinator, archive, servicer=SlowReducer)
        asker = Node(coordinator, network)
        try:
            started = time.monotonic()
            verdict = await judged(evidence, accuser, PeerRoundInputs(asker, timeout_s))
            return verdict, time.monotonic() - started
        finally:
            await node.close()
            await asker.close()

    timeout_s = 1.5
    (found, guilty), elapsed = asyncio.run(scenario(False, timeout_s))
    assert guilty is None and "showed the coordinator every input" in found, found
    assert SlowReducer.most_in_flight == len(evidence.missing), "every missing input is asked at once"
    assert timeout_s <= elapsed < len(evidence.missing) * timeout_s, elapsed

    deadline_s = 1.0
    monkeypatch.setattr(roundinputs, "DEMAND_DEADLINE_S", deadline_s)
    (found, guilty), elapsed = asyncio.run(scenario(True, 30.0))
    assert guilty == keys[0].peer_id and "did not show the coordinator" in found, found
    assert deadline_s <= elapsed < deadline_s + 5.0, elapsed


# --- 9. the run's layouts were built on the coordinator's event loop ----------------------------------------


def test_judge_unshown_builds_the_layouts_on_a_worker_thread_under_the_judging_lock(keys):
    """``layouts()`` (``run_layouts``: builds the run's model, cached after the first time) ran on the event
    loop, outside ``judging``: the first accusation after start, a malformed one included, stalled every
    RPC of the coordinator (heartbeats too) for as long as building the model on CPU takes.

    ``judge_unshown`` now calls it on a worker thread (``asyncio.to_thread``), and not under the judging
    lock: what it reads and demands must not wait behind other addresses' recomputes
    (``tests/test_judging_redteam2.py``). The callable runs on another thread than the loop's, and the
    judgment goes on.
    """
    calls = []

    async def run():
        judging = asyncio.Lock()

        def layouts():
            calls.append((threading.get_ident(), judging.locked()))
            return LAYOUTS

        evidence = unshown(signed_round(keys), (0,))
        verdict = await judge_unshown(
            RUN_CONFIG, layouts, evidence.to_bytes(), keys[0].peer_id, drawn_accuser(evidence),
            inputs=ReducerAnswers(None), joined_at=lambda p: asyncio.sleep(0, JOINED_S), judging=judging,
            now=lambda: SIGNED_S,
        )  # fmt: skip
        return threading.get_ident(), verdict

    loop_thread, (found, guilty) = asyncio.run(run())
    assert len(calls) == 1
    layouts_thread, locked = calls[0]
    assert layouts_thread != loop_thread, "the layouts are built off the event loop"
    assert not locked, "not behind the judging lock"
    assert guilty == keys[0].peer_id and "did not show the coordinator" in found
