"""Red-team demonstrations against ``unshown_input`` evidence and the coordinator's demand for inputs.

Each test PASSES while the defect it names is present: it asserts the bad outcome (an honest peer
banned, a lying reducer let go, an exception escaping the judge). Fix the defect and the test fails;
then turn its assertion around into a regression test.

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
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import AsyncIterator  # noqa: UP035 - hivemind reads typing hints

import pytest
import torch
from hivemind.p2p import P2PContext, PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo
from hivemind.utils.multiaddr import Multiaddr
from test_evidence import (
    CODEC,
    PREFIX,
    RULE,
    RUN,
    SIGNED_AT_MS,
    VECTOR,
    ReducerAnswers,
    signed_round,
    unshown,
)

from coordinator.roundinputs import DEMAND_ATTEMPTS, PeerRoundInputs, RoundInputs, judge_unshown
from coordinator.service import CoordinatorService
from coordinator.store import PeerRecord, Store
from protocols import averaging_pb2 as apb
from protocols.codec import pack
from protocols.envelope import MAX_CLOCK_SKEW_S
from protocols.keys import PublicKey, SigningKey
from swarm.averaging.archive import MAX_KEPT_INPUT_BYTES, InputArchive
from swarm.averaging.averager import AveragingServicer
from swarm.averaging.evidence import (
    INPUT_DEMAND_WINDOW_S,
    BadAggregateEvidence,
    SignedInput,
    UnshownInputEvidence,
    aggregate_message,
    aggregation_seed,
    chunk_numel,
    contribution_message,
    draw_seed,
    drawn_validator,
    input_entries,
    layout_chunk_values,
    parse_entries,
    reduce_chunk,
    round_digest,
)
from swarm.averaging.policy import PeerPolicy
from swarm.averaging.reducer import PartReducer
from swarm.averaging.rounds import RoundRegistry
from swarm.averaging.sender import PartSender
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


@pytest.fixture(scope="module")
def keys() -> list[SigningKey]:
    return [SigningKey.generate() for _ in range(3)]


# --- helpers ---------------------------------------------------------------------------------------------


def round_with(
    keys: list[SigningKey], *, nonces: list[bytes], signed_at_ms: int, shift: float = 0.0, part: int = 0
) -> BadAggregateEvidence:
    """``test_evidence.signed_round`` with the members' nonces and the reducer's signed time chosen."""
    members = tuple(k.peer_id for k in keys)
    group_id, commits = b"group-redteam", tuple(hashlib.sha256(n).digest() for n in nonces)
    digest = round_digest(PREFIX, group_id, members, commits)
    numel = chunk_numel(VECTOR, len(keys), part, 0, layout_chunk_values(len(keys), CODEC.bytes_per_value))
    generator = torch.Generator().manual_seed(2)
    inputs = []
    for index, key in enumerate(keys):
        data = CODEC.encode(torch.randn(numel, generator=generator))
        signature = key.sign(contribution_message(digest, part, 0, members[index], 8.0, data))
        inputs.append(SignedInput(index, data, signature, 8.0))
    decoded = [CODEC.decode(i.data, numel, sender="x") for i in inputs]
    output = reduce_chunk(RULE, CODEC, decoded, [8.0] * len(keys), aggregation_seed(group_id, part, 0))
    if shift:
        output = CODEC.encode(CODEC.decode(output, numel, sender="x") + shift)
    entries = input_entries([(i.sender_index, i.weight, i.data) for i in inputs])
    signature = keys[part].sign(
        aggregate_message(digest, part, 0, members[part], entries, output, signed_at_ms)
    )
    return BadAggregateEvidence(
        prefix=PREFIX, group_id=group_id, members=members, commitments=commits, part=part, chunk=0,
        numel=numel, inputs=tuple(inputs), output=output, output_signature=signature, entries=entries,
        signed_at_ms=signed_at_ms,
    )  # fmt: skip


def as_unshown(
    full: BadAggregateEvidence, nonces: list[bytes], missing: tuple[int, ...]
) -> UnshownInputEvidence:
    fields = {f: getattr(full, f) for f in BadAggregateEvidence.__dataclass_fields__}
    shown = tuple(i for i in full.inputs if i.sender_index not in missing)
    return UnshownInputEvidence(**{**fields, "inputs": shown}, missing=missing, reveals=tuple(nonces))


def drawn_accuser(evidence: UnshownInputEvidence) -> str:
    return evidence.members[drawn_validator(draw_seed(evidence.digest, evidence.reveals), evidence.part, 3)]


async def judged(evidence, accuser, inputs, *, online=True, now_s=SIGNED_AT_MS / 1000 + 10.0, accused=None):
    async def is_online(peer_id):
        return online if isinstance(online, bool) else await online(peer_id)

    return await judge_unshown(
        RUN_CONFIG, lambda: LAYOUTS, evidence.to_bytes(), accused or evidence.accused, accuser,
        inputs=inputs, online=is_online, judging=asyncio.Lock(), now=lambda: now_s,
    )  # fmt: skip


@dataclass
class FinishedRound:
    """What ``InputArchive.keep`` reads of a finished ``ButterflyAllReduce``."""

    group_id: bytes
    members: list[str]
    held: dict

    def aggregated_inputs(self):
        return self.held


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


# --- 1. a lying reducer backdates its aggregate and walks out of the demand window --------------------------


def test_a_backdated_aggregate_passes_every_member_and_leaves_no_time_to_demand_its_inputs(keys):
    """HIGH — a lying reducer escapes ``unshown_input`` entirely by dating its aggregate in the past.

    Members accept a signed time up to ``MAX_CLOCK_SKEW_S`` (120 s) off their clock in either direction
    (``sender.py:_check_answer``), and the coordinator demands inputs only while ``now - signed_at`` is
    within ``INPUT_DEMAND_WINDOW_S`` (120 s, ``roundinputs.py:judge_unshown``). Both are 120 s, so a reducer
    that signs ``signed_at_ms = now - 119 s`` passes every member's check and leaves the validator about
    one second to wait out the reveal phase, collect the inputs, and get its accusation judged. Here the
    evidence arrives 10 s after the real signing: the reducer, which lied (its aggregate is shifted) and
    shows nothing, is let go, while the same evidence with an honest date convicts it.
    """
    now_ms = int(time.time() * 1000)
    nonces = [os.urandom(32) for _ in keys]
    backdated_ms = now_ms - int((MAX_CLOCK_SKEW_S - 1) * 1000)
    lying = round_with(keys, nonces=nonces, signed_at_ms=backdated_ms, shift=0.5)
    # Member 1 checks the aggregate it got back, as ``PartSender._check_answer`` does: it passes.
    member = SimpleNamespace(
        members=list(lying.members), key=keys[1], digest=lying.digest, index=1, weight=8.0
    )
    answer = apb.PartChunk(
        part_index=0, chunk_index=0, data=lying.output, signature=lying.output_signature,
        included=lying.entries, signed_at_ms=lying.signed_at_ms,
    )  # fmt: skip
    PartSender._check_answer(member, 0, 0, answer, hashlib.sha256(lying.inputs[1].data).digest())

    evidence = as_unshown(lying, nonces, missing=(0,))
    found, guilty = asyncio.run(
        judged(evidence, drawn_accuser(evidence), ReducerAnswers(None), now_s=now_ms / 1000 + 10.0)
    )
    assert guilty is None and "past the" in found, "the liar walks"
    # Control: the same lie, honestly dated, is convicted.
    honest_date = as_unshown(round_with(keys, nonces=nonces, signed_at_ms=now_ms, shift=0.5), nonces, (0,))
    _, guilty = asyncio.run(
        judged(honest_date, drawn_accuser(honest_date), ReducerAnswers(None), now_s=now_ms / 1000 + 10.0)
    )
    assert guilty == keys[0].peer_id
    assert INPUT_DEMAND_WINDOW_S <= MAX_CLOCK_SKEW_S


# --- 2. a reducer commits to a long nonce: its honest validator's evidence bans the validator ---------------


def test_a_nonce_longer_than_64_bytes_makes_the_honest_validators_evidence_ban_the_validator(keys):
    """HIGH — one attacker, as reducer, lies, shows nothing, and gets its honest validator banned.

    Peers accept any reveal whose SHA-256 is the sender's commitment (``reducer.py:_check_reveal``), of
    any length; honest nonces are 32 bytes, but nothing stops an attacker committing to a 100-byte one.
    The coordinator's parser refuses reveals over 64 bytes (``evidence.py:UnshownInputEvidence.from_body``),
    and a parse failure is the accuser's fault. So the validator's ``_unshown`` (``verification.py``),
    which files the round's reveals without checking its own evidence first, files evidence that can
    never hold: the honest validator is banned, and the lying reducer (shifted aggregate, no input shown)
    is never asked.
    """
    nonces = [os.urandom(100), os.urandom(32), os.urandom(32)]  # the reducer of part 0 is the attacker
    lying = round_with(keys, nonces=nonces, signed_at_ms=SIGNED_AT_MS, shift=0.5)
    commits = list(lying.commitments)
    # Member 1, as a reducer, takes the attacker's reveal: it matches the commitment.
    reducer_view = SimpleNamespace(index=1, _results=[None], commitments=commits, reveals={})
    PartReducer._check_reveal(reducer_view, 0, apb.PartChunk(part_index=1, chunk_index=1, reveal=nonces[0]))
    assert reducer_view.reveals[0] == nonces[0]
    # The drawn validator could not get the reducer's own input (it shows nothing): it files, as
    # ``check_reducer`` does, through ``_unshown``.
    seed = draw_seed(lying.digest, nonces)
    validator = drawn_validator(seed, 0, 3)
    runner = SimpleNamespace(
        shared_seed=seed, commitments=commits, reveals=dict(enumerate(nonces)), members=list(lying.members)
    )
    check = SimpleNamespace(
        round=dict(prefix=PREFIX, group_id=lying.group_id, members=lying.members, commitments=lying.commitments,
                   part=0, chunk=0, reducers=(), signer=None),
        numel=lying.numel, part=0, chunk=0,
    )  # fmt: skip
    answer = apb.PartChunk(
        part_index=0, chunk_index=0, data=lying.output, signature=lying.output_signature,
        included=lying.entries, signed_at_ms=lying.signed_at_ms,
    )  # fmt: skip
    found = [None, lying.inputs[1], lying.inputs[2]]
    outcome = _unshown(runner, check, answer, parse_entries(lying.entries, 3), found, Outcome())
    assert isinstance(outcome.evidence, UnshownInputEvidence) and outcome.verdict is not None
    accuser = lying.members[validator]
    answers = ReducerAnswers(None)
    found, guilty = asyncio.run(judged(outcome.evidence, accuser, answers))
    assert guilty == accuser and "64 bytes" in found, "the honest validator is banned"
    assert answers.asked == [], "the lying reducer is never even asked"


# --- 3. an honest reducer that restarted is convicted for the archive it lost --------------------------------


def test_an_honest_reducer_that_restarted_within_the_window_is_banned(keys):
    """MEDIUM — an honest reducer that restarts (crash, upgrade, preemption) within the window is banned.

    ``InputArchive`` lives in memory only, and the coordinator's ``online`` is the store's state, which a
    restarted peer regains as soon as it joins again (or keeps for ``offline_after_s`` after a crash).
    The reducer's own input can only come from the reducer, so even an honest validator that checks while
    the reducer is down files ``unshown_input``; a malicious one just files at the right moment. The
    coordinator's real ``PeerRoundInputs`` asks the restarted reducer's real handler, which answers
    NO_EVIDENCE, and the honest reducer is banned. Before the restart the same demand was answered.
    """
    honest = signed_round(keys)
    evidence = unshown(honest, (0,))
    accuser = drawn_accuser(evidence)
    coordinator = SigningKey.generate().peer_id
    reducer = keys[0].peer_id

    async def scenario(tmp):
        store = Store.open_sync(tmp / "store.db", RUN)
        try:
            await store.admit(PeerRecord(reducer, b"", "r", "cpu", "data", "online", 0.0, 0.0, 0, 1, 1e12))
            online = lambda peer: CoordinatorService._online(SimpleNamespace(store=store), peer)  # noqa: E731
            verdicts = []
            for archive in (InputArchive(), InputArchive()):  # before the restart, and after it
                if not verdicts:
                    archive.keep(kept(honest))
                network: dict[str, Node] = {}
                node = await reducer_node(network, reducer, coordinator, archive)
                asker = Node(coordinator, network)
                try:
                    verdicts.append(
                        await judged(evidence, accuser, PeerRoundInputs(asker, 2.0), online=online)
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
    assert after[1] == reducer, "the honest reducer, restarted, is banned"


# --- 4. certified sybils fill the reducer's rpc_round_inputs slots while the coordinator asks ----------------


def test_silent_streams_from_certified_peers_make_the_coordinator_ban_an_honest_reducer(keys):
    """MEDIUM — framing by slot exhaustion: any failure to get an answer convicts an online reducer.

    ``rpc_round_inputs`` takes ``MAX_STREAMS`` (256) streams at once, ``MAX_CONNECTIONS_PER_PEER`` (8) per
    caller; a stream of a certified peer holds its slot ``FIRST_REQUEST_TIMEOUT_S`` (10 s) before sending
    anything. The judge is exempt from admission (``policy.py:admission``) but not from the slots
    (``inbound.py:_Slots.enter`` runs first). ``PeerRoundInputs.fetch`` turns the refusal into "not shown",
    and ``judge_unshown`` bans an online reducer for it. 32 certified identities re-opening silent streams
    every 10 s, timed with their own accusation, get an honest reducer that holds the input banned. The
    same root cause convicts a reducer for the coordinator's own dial failures (its libp2p node down, no
    address for the reducer), which ``judge_unshown`` cannot tell from a refusal.
    """
    honest = signed_round(keys)
    evidence = unshown(honest, (0,))
    accuser = drawn_accuser(evidence)
    coordinator = SigningKey.generate().peer_id
    sybils = [SigningKey.generate().peer_id for _ in range(MAX_STREAMS // MAX_CONNECTIONS_PER_PEER)]

    async def scenario():
        verdicts = []
        for flood in (False, True):
            archive = InputArchive()
            archive.keep(kept(honest))  # the honest reducer holds the input
            network: dict[str, Node] = {}
            node = await reducer_node(network, keys[0].peer_id, coordinator, archive, certified=sybils)
            callers = [Node(coordinator, network)] + [Node(s, network) for s in sybils]
            try:
                if flood:
                    name = AveragingServicer._get_handle_name(PREFIX, "rpc_round_inputs")
                    for sybil in callers[1:]:
                        for _ in range(MAX_CONNECTIONS_PER_PEER):
                            await sybil.call_binary_stream_handler(node.peer_id, name)
                    await asyncio.sleep(0.3)  # their handlers have taken their slots and wait for a request
                verdicts.append(await judged(evidence, accuser, PeerRoundInputs(callers[0], 2.0)))
            finally:
                await node.close()
                for caller in callers:
                    await caller.close()
        return verdicts

    calm, flooded = asyncio.run(scenario())
    assert calm[1] is None and "showed the coordinator every input" in calm[0]
    assert flooded[1] == keys[0].peer_id, "the honest reducer is banned"


# --- 5. a lying reducer leaves the run when the demand comes, and joins again -------------------------------


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


def test_a_lying_reducer_that_leaves_when_asked_is_let_go_and_joins_again(keys):
    """MEDIUM — ``online`` is read after the demand fails, so a liar that sees the demand coming escapes.

    The demand comes from the coordinator's peer ID, so the reducer knows it is being judged. It sends a
    Leave (state 'left') and answers nothing; ``judge_unshown`` then finds it not online and bans nobody
    ("left the run"). It joins again at once (``join`` only checks the ban list), unbanned. Stalling the
    demand stream (2 tries x 20 s) while skipping heartbeats for ``offline_after_s`` (15 s) does the same
    without a Leave: the sweep marks it offline, and its next heartbeat makes it online again.
    """
    lying = signed_round(keys, shift=0.5)
    evidence = unshown(lying, (0,))
    accuser = drawn_accuser(evidence)
    coordinator = SigningKey.generate().peer_id
    reducer = keys[0].peer_id
    record = PeerRecord(reducer, b"", "r", "cpu", "data", "online", 0.0, 0.0, 0, 1, 1e12)

    async def scenario(tmp):
        store = Store.open_sync(tmp / "store.db", RUN)
        try:
            await store.admit(record)
            LeavingReducer.store, LeavingReducer.reducer = store, reducer
            online = lambda peer: CoordinatorService._online(SimpleNamespace(store=store), peer)  # noqa: E731
            network: dict[str, Node] = {}
            node = await reducer_node(network, reducer, coordinator, InputArchive(), servicer=LeavingReducer)
            asker = Node(coordinator, network)
            try:
                verdict = await judged(evidence, accuser, PeerRoundInputs(asker, 2.0), online=online)
            finally:
                await node.close()
                await asker.close()
            await store.admit(dataclasses.replace(record, last_seen=time.time()))  # it joins again
            return verdict, await store.get_peer(reducer)
        finally:
            store.close()

    with tempfile.TemporaryDirectory() as tmp:
        (found, guilty), after = asyncio.run(scenario(Path(tmp)))
    assert guilty is None and "left the run" in found, "the liar is let go"
    assert after.state == "online", "and is back, unbanned"


# --- 6. withheld reveals push an honest reducer's archive out, or keep it from being written ---------------


def test_a_withheld_reveal_fills_the_archive_and_evicts_the_round_the_coordinator_asks_about(keys):
    """MEDIUM/LOW — a colluder that withholds its reveal from the reducer only makes an honest reducer
    unable to show a round it signed, and the colluding validator (which has every reveal) files.

    A round whose draw is incomplete at the reducer keeps every chunk (``allreduce.py:_trim`` returns
    early), and ``InputArchive.keep`` archives them all: about the whole model's wire size (its part, from
    every member). For a model between ~64M and ~128M parameters at fp16 that fits in 256 MiB and evicts
    every older round (oldest first); above it the round is not archived at all. Once the earlier round
    has also left the registry (``KEEP_ROUNDS`` = 4 rounds, which a fast run passes within the window), the
    coordinator's demand gets NO_EVIDENCE and the honest reducer is banned. Here the default archive is
    used; the big round's inputs share one buffer, so only the archive's byte count is large.
    """
    honest = signed_round(keys)
    evidence = unshown(honest, (1,))
    accuser = drawn_accuser(evidence)
    coordinator = SigningKey.generate().peer_id
    archive = InputArchive()
    archive.keep(kept(honest))
    assert archive.lookup(honest.group_id, 0, 0, 1) is not None
    # The next round, whose draw a colluder kept from this reducer: every chunk of its part, from every
    # member, just under the archive's bound (so it is kept) and more than the room left (so it evicts).
    target, block = MAX_KEPT_INPUT_BYTES - 64, bytes(8 << 20)  # one buffer: only the count is large
    datas = [block] * (target // (len(block) + 64))
    datas.append(bytes(target - len(datas) * (len(block) + 64) - 64))
    withheld = FinishedRound(
        os.urandom(8), list(honest.members),
        {(0, j // 3): [] for j in range(len(datas))},
    )  # fmt: skip
    for j, data in enumerate(datas):
        withheld.held[(0, j // 3)].append(SignedInput(j % 3, data, bytes(64), 8.0))
    archive.keep(withheld)
    assert archive.lookup(withheld.group_id, 0, 0, 0) is not None
    assert archive.lookup(honest.group_id, 0, 0, 1) is None, "the round under demand is gone"
    _, guilty = asyncio.run(judged(evidence, accuser, ArchiveAnswers(archive, coordinator)))
    assert guilty == keys[0].peer_id, "the honest reducer is banned"


# --- 7. malformed evidence: exceptions escape the judge, and a tiny evidence allocates what it names --------


def test_an_integer_where_bytes_belong_escapes_the_judge_or_makes_it_allocate_that_many_bytes(keys):
    """MEDIUM (pre-existing helpers, reachable through ``unshown_input``) — ``_round_fields`` and ``_signed``
    call ``bytes(x)`` on fields the accuser chose; an int there is a size. ``2**63`` raises OverflowError
    (``2**62`` MemoryError), neither of which ``parse_evidence`` turns into ProtocolError, so it escapes
    ``judge_unshown`` and the accuser is never judged guilty. A moderate int makes the coordinator allocate
    that many bytes, and ``round_digest`` then copies them (``b"|".join``) on the judging thread: a
    200-byte accusation can make the coordinator take and touch gigabytes.
    """
    body = unshown(signed_round(keys), (0,))._body()
    accuser = drawn_accuser(unshown(signed_round(keys), (0,)))

    async def judge_raw(data):
        return await judge_unshown(
            RUN_CONFIG, lambda: LAYOUTS, data, keys[0].peer_id, accuser, inputs=ReducerAnswers(None),
            online=lambda p: asyncio.sleep(0, True), judging=asyncio.Lock(), now=lambda: SIGNED_AT_MS / 1000,
        )  # fmt: skip

    with pytest.raises(OverflowError):
        asyncio.run(judge_raw(pack({**body, "commitments": [2**63, *body["commitments"][1:]]})))
    with pytest.raises(OverflowError):
        asyncio.run(judge_raw(pack({**body, "inputs": [[1, 2**63, b"", 8.0]]})))

    size = 32 << 20
    small = pack({**body, "group_id": size, "inputs": []})
    assert len(small) < 4096  # nearly all of it the reducer's output, signature and entries
    tracemalloc.start()
    try:
        found, guilty = asyncio.run(judge_raw(small))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert guilty == accuser  # refused in the end (the signature fails) ...
    assert peak >= 2 * size, "... after allocating and copying what the accuser named"


# --- 8. a colluding reducer that answers slowly keeps an accusation (and its evidence bytes) open ----------


class SlowReducer(AveragingServicer):
    """A colluding reducer: it lets the first try of each demand time out, and answers the second."""

    seen: set

    async def rpc_round_inputs(
        self, request: apb.InputsRequest, context: P2PContext
    ) -> AsyncIterator[apb.SignedInput]:
        if request.sender_index not in self.seen:
            self.seen.add(request.sender_index)
            await asyncio.sleep(3600)
        async for item in super().rpc_round_inputs(request, context):
            yield item


def test_a_slow_but_honest_answer_holds_the_judgment_for_a_timeout_per_input_and_bans_nobody(keys):
    """MEDIUM/LOW — the demand has no overall deadline, and the accuser pays nothing when all is shown.

    ``judge_unshown`` asks for each missing input in turn, each with ``DEMAND_ATTEMPTS`` (2) tries of
    ``DEMAND_TIMEOUT_S`` (20 s). A colluding reducer that lets every first try time out and answers the
    second keeps one accusation open ~20 s per missing input (a colluding validator may list every entry
    as missing: up to 1,023 in a group of 1,024, over 5 hours). ``CoordinatorService.accuse`` releases the
    accusation's evidence bytes only after the verdict (``reader.release()`` in ``finally``), so a few
    such accusations hold the global evidence budget (256 MiB) far past ``evidence_read_timeout_s``, and
    honest accusations that wait for it time out. The recomputation at the end also runs under the
    shared judging lock, and unlike ``bad_aggregate`` costs the accuser nothing. Scaled: 0.3 s a try.
    """
    honest = signed_round(keys)
    evidence = unshown(honest, (0, 1, 2))
    evidence = dataclasses.replace(evidence, inputs=())
    accuser = drawn_accuser(evidence)
    coordinator = SigningKey.generate().peer_id
    timeout_s = 0.3

    async def scenario():
        archive = InputArchive()
        archive.keep(kept(honest))
        SlowReducer.seen = set()
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

    (found, guilty), elapsed = asyncio.run(scenario())
    assert guilty is None and "showed the coordinator every input" in found, "nobody pays"
    assert elapsed >= len(evidence.missing) * (DEMAND_ATTEMPTS - 1) * timeout_s


# --- 9. the run's layouts are built on the coordinator's event loop -----------------------------------------


def test_judge_unshown_builds_the_layouts_on_the_event_loop(keys):
    """LOW — ``judge_unshown`` calls ``layouts()`` (``run_layouts``: builds the model, cached after the
    first time) on the event loop, outside ``judging``; ``judge`` documents and does it on the judging
    thread. The first accusation after start, a malformed one included, stalls every RPC of the
    coordinator (heartbeats too) for as long as building the run's model on CPU takes.
    """
    threads = []

    def layouts():
        threads.append(threading.current_thread())
        return LAYOUTS

    evidence = unshown(signed_round(keys), (0,))

    async def run():
        return await judge_unshown(
            RUN_CONFIG, layouts, evidence.to_bytes(), keys[0].peer_id, drawn_accuser(evidence),
            inputs=ReducerAnswers(None), online=lambda p: asyncio.sleep(0, True), judging=asyncio.Lock(),
            now=lambda: SIGNED_AT_MS / 1000,
        )  # fmt: skip

    asyncio.run(run())
    assert threads == [threading.main_thread()]
