"""Inbound bounds: what an unadmitted or greedy peer can make an honest peer read, hold or serve.

Real hivemind P2P daemons on loopback and the project's real servicers; the attacker writes raw frames in
hivemind's wire format (marker, 8-byte length, body), as anyone with the code could.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import os
import pkgutil
import time
from typing import AsyncIterator as TypingAsyncIterator  # noqa: UP035 - hivemind reads typing hints

import pytest
from hivemind.dht.protocol import DHTProtocol
from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase
from hivemind.p2p.p2p_daemon_bindings.control import P2PHandlerError

from protocols import averaging_pb2 as apb
from protocols.errors import ConfigError
from protocols.keys import SigningKey
from swarm.averaging.averager import Averager, AveragingServicer
from swarm.averaging.policy import PeerPolicy
from swarm.averaging.transport import DataPlane
from swarm.inbound import SMALL_REQUEST_BYTES, BoundedServicer, HandlerBound
from swarm.training.sync import StateServicer, download_state, state_namespace

RUN = "inbound-run"
CLAIMED_BYTES = 192 << 20
SENT_BYTES = 64 << 20
ATTACK_TIMEOUT_S = 30.0


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def state_pair(member: bool = False) -> tuple[P2P, P2P, StateServicer]:
    """An honest state holder and a stranger connected to it; the holder admits nobody (with ``member``,
    it admits the caller, and holds no state to send it)."""
    honest = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    stranger = await P2P.create(
        host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=await honest.get_visible_maddrs()
    )

    async def provide():
        return None

    async def admit(requester: str) -> str | None:
        return None if member else f"{requester} is not a member"

    servicer = StateServicer(RUN, provide, admit=admit)
    await servicer.add_p2p_handlers(honest, namespace=state_namespace(RUN))
    return honest, stranger, servicer


async def first_bytes(reader: asyncio.StreamReader, within_s: float = 3.0) -> bytes:
    """What the server sends within ``within_s``, read until it closes (a refusal may arrive in pieces);
    an accepted stream gets nothing, as the handler waits for the request."""
    received, deadline = b"", time.monotonic() + within_s
    while (left := deadline - time.monotonic()) > 0:
        try:
            piece = await asyncio.wait_for(reader.read(4096), left)
        except asyncio.TimeoutError:
            break
        if not piece:
            break
        received += piece
    return received


def handle_name() -> str:
    return StateServicer._get_handle_name(state_namespace(RUN), "rpc_download_state")


@pytest.mark.timeout(90)
def test_an_oversized_length_prefix_is_refused_before_its_bytes_are_buffered():
    """A stranger claims a 192 MiB request and streams 64 MiB of it: the honest process must not hold it."""

    async def scenario() -> tuple[int, int, bool]:
        honest, stranger, servicer = await state_pair()
        try:
            _, reader, writer = await stranger.call_binary_stream_handler(honest.peer_id, handle_name())
            baseline = peak = rss_bytes()
            writer.write(P2P.MESSAGE_MARKER + CLAIMED_BYTES.to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER))
            chunk, sent, deadline = bytes(1 << 20), 0, time.monotonic() + ATTACK_TIMEOUT_S
            while sent < SENT_BYTES and time.monotonic() < deadline:
                try:
                    writer.write(chunk)
                    await asyncio.wait_for(writer.drain(), 5)
                except (ConnectionError, asyncio.TimeoutError):
                    break  # the honest side closed the stream: what we want
                sent += len(chunk)
                peak = max(peak, rss_bytes())
            await asyncio.sleep(0.5)  # let whatever the honest side still reads arrive
            peak = max(peak, rss_bytes())
            try:  # the refusal, or a reset once the honest side has closed the stream
                closed = await asyncio.wait_for(reader.read(), 5) is not None
            except ConnectionError:
                closed = True
            except asyncio.TimeoutError:
                closed = False
            writer.close()
            return peak - baseline, getattr(servicer, "inbound_refused", 0), closed
        finally:
            await stranger.shutdown()
            await honest.shutdown()

    growth, refused, closed = asyncio.run(scenario())
    assert growth < 16 << 20, f"the honest process grew by {growth / 2**20:.0f} MiB"
    assert refused == 1 and closed, "the stream is refused and closed"


@pytest.mark.timeout(90)
def test_a_holder_that_claims_a_192_mib_chunk_fails_the_download_without_being_buffered():
    """The caller's side of a stream is inbound too: a hostile state holder answers with a huge length."""

    async def scenario() -> tuple[int, str]:
        victim = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        holder = await P2P.create(
            host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=await victim.get_visible_maddrs()
        )

        async def hostile(_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.read(64)  # the request
            writer.write(P2P.MESSAGE_MARKER + CLAIMED_BYTES.to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER))
            chunk, deadline = bytes(1 << 20), time.monotonic() + ATTACK_TIMEOUT_S
            for _ in range(SENT_BYTES // len(chunk)):
                if time.monotonic() > deadline:
                    break
                try:
                    writer.write(chunk)
                    await asyncio.wait_for(writer.drain(), 5)
                except (ConnectionError, asyncio.TimeoutError):
                    break  # the victim closed the stream: what we want
            writer.close()

        await holder.add_binary_stream_handler(handle_name(), hostile)
        baseline = rss_bytes()
        try:
            await download_state(victim, holder.peer_id, namespace=state_namespace(RUN), run_id=RUN, min_step=0,
                                 expected_hash="0" * 64, max_bytes=8 << 20, timeout_s=30)  # fmt: skip
            outcome = "downloaded"
        except Exception as e:
            outcome = repr(e)
        growth = rss_bytes() - baseline
        await holder.shutdown()
        await victim.shutdown()
        return growth, outcome

    growth, outcome = asyncio.run(scenario())
    assert "MessageTooLarge" in outcome and "exceeds" in outcome, outcome
    assert growth < 16 << 20, f"the caller grew by {growth / 2**20:.0f} MiB"


@pytest.mark.timeout(60)
def test_a_request_at_the_bound_is_served_and_one_byte_more_is_refused():
    async def scenario() -> tuple[list[str], str]:
        honest, stranger, _ = await state_pair(member=True)
        try:
            stub = StateServicer.get_stub(stranger, honest.peer_id, namespace=state_namespace(RUN))
            at_bound = apb.StateRequest(run_id="x" * (SMALL_REQUEST_BYTES - 8), min_step=1)
            at_bound.run_id += "x" * (SMALL_REQUEST_BYTES - at_bound.ByteSize())
            assert at_bound.ByteSize() == SMALL_REQUEST_BYTES
            served = [chunk.error async for chunk in await stub.rpc_download_state(at_bound)]
            over = apb.StateRequest(run_id=at_bound.run_id + "x", min_step=1)
            with pytest.raises(P2PHandlerError) as refused:
                _ = [chunk async for chunk in await stub.rpc_download_state(over)]
            return served, str(refused.value)
        finally:
            await stranger.shutdown()
            await honest.shutdown()

    served, refused = asyncio.run(scenario())
    assert len(served) == 1 and "this peer trains run" in served[0], "the handler itself read and answered it"
    assert f"of {SMALL_REQUEST_BYTES + 1} bytes exceeds" in refused


@pytest.mark.timeout(60)
def test_the_stream_past_the_per_peer_cap_is_refused_and_a_closed_one_frees_its_slot():
    """Five silent streams from one peer: whichever reaches the handler last is refused unread, the other
    four wait for their request; once they close, the peer is served again."""
    cap = 4  # StateServicer's max_streams_per_peer

    async def scenario() -> tuple[list[bytes], list[str]]:
        honest, stranger, _ = await state_pair(member=True)
        try:
            streams = [
                await stranger.call_binary_stream_handler(honest.peer_id, handle_name())
                for _ in range(cap + 1)
            ]
            answers = await asyncio.gather(*(first_bytes(reader) for _, reader, _ in streams))
            for _, _, writer in streams:
                writer.close()
            stub = StateServicer.get_stub(stranger, honest.peer_id, namespace=state_namespace(RUN))
            served: list[str] = []
            deadline = time.monotonic() + 10
            while not served and time.monotonic() < deadline:  # the server sees the closes shortly after
                try:
                    served = [
                        c.error async for c in await stub.rpc_download_state(apb.StateRequest(run_id=RUN))
                    ]
                except P2PHandlerError:
                    await asyncio.sleep(0.1)
            return answers, served
        finally:
            await stranger.shutdown()
            await honest.shutdown()

    answers, served = asyncio.run(scenario())
    refused = [a for a in answers if a]
    assert len(refused) == 1 and b"already has 4 streams open" in refused[0], answers
    assert served and "no state at step 0" in served[0], "a freed slot serves the next stream"


def project_servicers() -> list[type[ServicerBase]]:
    for package in ("swarm", "peer", "coordinator", "lab"):
        root = importlib.import_module(package)
        for module in pkgutil.walk_packages(root.__path__, prefix=f"{package}."):
            importlib.import_module(module.name)
    found, todo = [], list(ServicerBase.__subclasses__())
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if cls.__module__.split(".")[0] in ("swarm", "peer", "coordinator", "lab"):
            found.append(cls)
    return found


@pytest.mark.timeout(120)
def test_every_handler_the_project_registers_has_an_inbound_bound():
    servicers = project_servicers()
    assert {c.__name__ for c in servicers} >= {"AveragingServicer", "StateServicer", "StageServicer"}
    for cls in servicers:
        if issubclass(cls, DHTProtocol):
            # hivemind's DHT protocol registers its own handlers; they must stay unary, so that the p2p
            # daemon drops a request over 4 MiB before Python reads it, and what they store is bounded by
            # swarm.dhtstorage (tests/test_dht_trust.py).
            streaming = [
                name for name in dir(cls)
                if name.startswith("rpc_") and inspect.isasyncgenfunction(getattr(cls, name))
            ]  # fmt: skip
            assert streaming == [], f"{cls.__name__} streams {streaming}, which the daemon does not bound"
            continue
        assert issubclass(cls, BoundedServicer), f"{cls.__module__}.{cls.__name__} reads unbounded messages"
        assert cls.unbounded_handlers() == [], f"{cls.__name__} has handlers without a bound"


def test_registering_a_handler_without_a_bound_fails():
    class Forgetful(BoundedServicer):
        bounds = {"rpc_one": lambda self: HandlerBound(64, 1)}

        async def rpc_one(self, request: apb.StateRequest, context: P2PContext) -> apb.StateChunk:
            return apb.StateChunk()

        async def rpc_two(
            self, request: apb.StateRequest, context: P2PContext
        ) -> TypingAsyncIterator[apb.StateChunk]:
            yield apb.StateChunk()

    BoundedServicer.registered.remove(Forgetful)
    with pytest.raises(ConfigError, match="no inbound bound for rpc_two"):
        asyncio.run(Forgetful().add_p2p_handlers(None))


class Recorder:
    """The data plane's handler: records who got as far as sending frames."""

    def __init__(self):
        self.senders: list[str] = []

    async def __call__(self, frames, sender) -> TypingAsyncIterator[apb.PartChunk]:
        self.senders.append(sender.to_base58())
        async for frame in frames:
            yield frame


@pytest.mark.timeout(30)
def test_the_data_plane_refuses_an_uncertified_key_before_reading_a_frame():
    member, stranger = SigningKey.generate(), SigningKey.generate()

    async def admission(peer_id: str) -> str | None:
        return None if peer_id == member.peer_id else "not a certified member"

    async def scenario() -> tuple[str, list[str], int]:
        handler = Recorder()
        server = DataPlane(SigningKey.generate(), RUN, handler, max_frame=1 << 16, admission=admission)
        address = await server.start("127.0.0.1", 0, "127.0.0.1")
        server_id = PeerID.from_base58(server.key.peer_id)
        try:
            outcome = "connected"
            try:
                await DataPlane(stranger, RUN, Recorder(), max_frame=1 << 16).connect(address, server_id, 5)
            except Exception as e:
                outcome = repr(e)
            connection = await DataPlane(member, RUN, Recorder(), max_frame=1 << 16).connect(
                address, server_id, 5
            )

            async def one() -> TypingAsyncIterator[apb.PartChunk]:
                yield apb.PartChunk(chunk_index=7)

            echoed = [m.chunk_index async for m in connection.exchange(one())]
            return outcome, handler.senders, echoed[0]
        finally:
            await server.close()

    outcome, senders, echoed = asyncio.run(scenario())
    assert outcome != "connected", "the stranger's handshake must fail"
    assert senders == [member.peer_id], "only the certified member reached the handler"
    assert echoed == 7


@pytest.mark.timeout(120)
def test_a_part_stream_from_an_uncertified_peer_is_refused_before_its_first_byte(keyed_dhts):
    """The averager's libp2p part handler asks the peer policy before it reads: a stranger is told why at
    once, with nothing sent; a certified member's stream stays open, waiting for its chunks."""
    (honest, honest_key), (member, _), (stranger, _) = keyed_dhts
    policy = PeerPolicy(None, RUN, allowed=[honest.peer_id.to_base58(), member.peer_id.to_base58()])
    averager = Averager(
        honest, numel=1024, signing_key=honest_key, prefix=RUN, data_plane=False, policy=policy
    )
    name = AveragingServicer._get_handle_name(RUN, "rpc_aggregate_part")

    async def scenario() -> tuple[bytes, bool, int]:
        await averager.start()
        _, reader, writer = await (await stranger.replicate_p2p()).call_binary_stream_handler(
            averager.peer_id, name
        )
        refusal = await first_bytes(reader, within_s=10)
        writer.close()
        _, reader, writer = await (await member.replicate_p2p()).call_binary_stream_handler(
            averager.peer_id, name
        )
        try:
            await asyncio.wait_for(reader.read(1), 1.0)
            waiting = False
        except asyncio.TimeoutError:
            waiting = True
        writer.close()
        await averager.shutdown()
        return refusal, waiting, getattr(averager.servicer, "inbound_refused", 0)

    refusal, waiting, refused = asyncio.run(scenario())
    assert b"not a certified member" in refusal and refused == 1
    assert waiting, "a certified member's stream is read, not refused"


def test_strangers_asking_the_coordinator_for_stage_states_share_one_record_read_a_second(
    tmp_path, monkeypatch
):
    """Admission now runs before a stream takes a slot, for every stream: the coordinator's stage state
    handler reread the pipeline's records from the DHT for each requester it did not know, so a stranger
    opening streams made it look up the DHT once per stream. Now reads begin at most once per
    PIPELINE_REREAD_S, every requester waiting meanwhile shares the next one, and a replica that announced
    itself just before it asked is still admitted."""
    import coordinator.checkpoints as checkpoints
    from lab.localswarm import tiny_run
    from swarm.pipeline.records import PipelineView, StageRecord

    replica = SigningKey.generate().peer_id
    announced = PipelineView(holders={0: [StageRecord(replica, 0, 0, 1.0, 0.0, "", "", time.time())]})
    reads = []

    async def fetch_view(dht, trust, stages):
        reads.append(time.monotonic())
        return announced if len(reads) > 1 else PipelineView()

    monkeypatch.setattr(checkpoints, "fetch_view", fetch_view)
    keeper = checkpoints.CheckpointKeeper(tiny_run("reread"), None, SigningKey.generate(), tmp_path)

    async def flood() -> tuple[list[str | None], str | None]:
        strangers = [keeper._admit_stage(SigningKey.generate().peer_id) for _ in range(50)]
        refusals = await asyncio.gather(*strangers)
        return refusals, await keeper._admit_stage(replica)

    started = time.monotonic()
    refusals, admitted = asyncio.run(flood())
    assert all(r is not None and "no valid signed pipeline record" in r for r in refusals)
    assert admitted is None, "the replica that announced itself is found on the next read"
    assert len(reads) == 2, f"{len(reads)} DHT reads for 50 strangers and one replica"
    assert reads[1] - reads[0] >= checkpoints.PIPELINE_REREAD_S - 0.05
    assert time.monotonic() - started < 5 * checkpoints.PIPELINE_REREAD_S


class _RecordingWriter:
    def __init__(self) -> None:
        self.sent, self.closed = b"", False

    def write(self, data) -> None:
        self.sent += bytes(data)

    async def drain(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def _frame(message) -> bytes:
    body = message.SerializeToString()
    return P2P.MESSAGE_MARKER + len(body).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + body


def test_refused_streams_linger_for_their_refusal_to_arrive_but_only_a_bounded_number_at_once():
    """A refusal is sent, then the stream stays open (up to CLOSE_LINGER_S) so that closing it with the
    caller's request unread does not reset it before the refusal arrives. A refused stream holds no slot,
    so a stranger opening streams as fast as it can would keep any number of them open: past
    MAX_LINGERING_REFUSALS the refusal is sent and the stream closed at once."""
    from swarm import inbound

    async def scenario() -> tuple[list[bool], int, list[bytes], int]:
        callers = [
            (asyncio.StreamReader(), _RecordingWriter()) for _ in range(inbound.MAX_LINGERING_REFUSALS + 8)
        ]
        refusals = [asyncio.create_task(inbound._send_refusal("no", r, w)) for r, w in callers]
        await asyncio.sleep(0.1)  # well inside CLOSE_LINGER_S: the lingering ones are still open
        done, lingering = [t.done() for t in refusals], inbound._lingering
        for reader, _ in callers:
            reader.feed_eof()  # each caller closes once it has read the refusal
        await asyncio.wait_for(asyncio.gather(*refusals), 5)
        return done, lingering, [w.sent for _, w in callers], inbound._lingering

    done, lingering, sent, after = asyncio.run(scenario())
    assert lingering == inbound.MAX_LINGERING_REFUSALS and sum(done) == 8
    assert all(s.startswith(P2P.ERROR_MARKER) and s.endswith(b"no") for s in sent), "every caller is told why"
    assert after == 0


@pytest.mark.timeout(60)
def test_a_handler_that_answered_waits_for_the_callers_end_of_stream_before_closing():
    """A caller sends its request, then its end of stream. A handler that answered before the end of stream
    arrived closed with it unread, and the reset overtook the reply under load (a validator saw
    BrokenPipeError from an honest holder, avoided it, and a 2-peer run stopped). Now the stream stays open
    until the end of stream arrives (up to CLOSE_LINGER_S), then closes."""
    from swarm.inbound import CLOSE_LINGER_S, receive_bounded

    async def scenario() -> tuple[str, bytes, float]:
        honest, stranger, _ = await state_pair(member=True)
        try:
            _, reader, writer = await stranger.call_binary_stream_handler(honest.peer_id, handle_name())
            await P2P.send_protobuf(apb.StateRequest(run_id=RUN, min_step=1), writer)
            reply, _ = await asyncio.wait_for(receive_bounded(reader, apb.StateChunk, 1 << 20), 10)
            early = await first_bytes(reader, within_s=CLOSE_LINGER_S / 4)  # nothing yet: it waits for us
            sent = time.monotonic()
            await P2P.send_protobuf(P2P.END_OF_STREAM, writer)
            await asyncio.wait_for(reader.read(), 10)  # then it closes
            writer.close()
            return reply.error, early, time.monotonic() - sent
        finally:
            await stranger.shutdown()
            await honest.shutdown()

    error, early, closed_after_s = asyncio.run(scenario())
    assert "no state at step 1" in error, "the handler answered the request"
    assert early == b"", "the stream stayed open, with nothing more sent, until the caller's end of stream"
    assert closed_after_s < 5, "and closed once it came"


def test_a_caller_that_sends_more_than_the_handler_reads_gets_its_slot_back_when_the_handler_ends():
    """A caller sends a few more requests than the read-ahead holds while the handler is busy (a leader's
    rpc_join_group holds its follower for the matchmaking window). The reader waited to queue the next
    one, and once the handler returned nothing read the queue again: the stream and its slot were held
    until the process exited, so 32-64 certified identities could fill a handler for good (found by
    reading the close linger as an attacker would). Now the stream closes when the handler ends."""
    from types import SimpleNamespace

    from swarm import inbound

    bound = HandlerBound(max_message_bytes=1024, max_streams_per_peer=1)
    busy = asyncio.Event()

    async def handler(request, context):  # a unary request answered by a stream, like rpc_join_group
        await busy.wait()
        yield apb.SignedInput(code=apb.NO_EVIDENCE, error="done")

    async def scenario() -> tuple[bool, bool, bytes]:
        serve = BoundedServicer()._stream_handler(
            SimpleNamespace(peer_id="server"), "h", handler, apb.InputsRequest, False, bound,
            inbound.transfer_within_s(inbound.UNARY_MAX_BYTES),
        )  # fmt: skip
        info = SimpleNamespace(peer_id=SimpleNamespace(to_base58=lambda: "caller"))
        reader, writer = asyncio.StreamReader(), _RecordingWriter()
        reader.feed_data(_frame(apb.InputsRequest(part_index=1)) * (inbound.MAX_PREFETCH + 3))
        first = asyncio.create_task(serve(info, reader, writer))
        await asyncio.sleep(0.2)
        busy.set()  # the handler answers and returns
        await asyncio.wait_for(first, 5)
        again_reader, again_writer = asyncio.StreamReader(), _RecordingWriter()
        again_reader.feed_data(_frame(apb.InputsRequest(part_index=1)))
        again_reader.feed_eof()
        await asyncio.wait_for(serve(info, again_reader, again_writer), 5)
        return b"done" in writer.sent, writer.closed, again_writer.sent

    answered, closed, again = asyncio.run(scenario())
    assert answered and closed, "the handler answered, and the stream closed when it ended"
    assert b"done" in again and b"already has" not in again, "the caller's slot was given back"


def test_a_handler_cancelled_mid_read_leaves_no_unretrieved_read_behind():
    """A handler cancelled while it waits for the caller's next frame (its P2P shutting down, the call
    torn down) left that read pending; the caller's close then ended it with IncompleteReadError and
    asyncio printed "Task exception was never retrieved" (seen in a CI log). The read is discarded with
    the handler."""
    import gc
    from types import SimpleNamespace

    from swarm import inbound

    bound = HandlerBound(max_message_bytes=1024, max_streams_per_peer=1)

    async def handler(requests, context):  # a streaming handler that reads, then waits
        async for _ in requests:
            await asyncio.sleep(3600)
        yield apb.SignedInput(code=apb.NO_EVIDENCE)

    async def scenario() -> list[str]:
        unretrieved: list[str] = []
        asyncio.get_running_loop().set_exception_handler(lambda _, ctx: unretrieved.append(ctx["message"]))
        serve = BoundedServicer()._stream_handler(
            SimpleNamespace(peer_id="server"), "h", handler, apb.InputsRequest, True, bound,
            inbound.transfer_within_s(inbound.UNARY_MAX_BYTES),
        )  # fmt: skip
        info = SimpleNamespace(peer_id=SimpleNamespace(to_base58=lambda: "caller"))
        reader, writer = asyncio.StreamReader(), _RecordingWriter()
        reader.feed_data(_frame(apb.InputsRequest(part_index=1)))
        serving = asyncio.create_task(serve(info, reader, writer))
        await asyncio.sleep(0.2)  # the first request is in the handler, the next read is pending
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)
        reader.feed_eof()  # the caller closes
        await asyncio.sleep(0.1)
        gc.collect()
        await asyncio.sleep(0)
        return unretrieved

    assert asyncio.run(scenario()) == []


@pytest.mark.timeout(60)
def test_a_strangers_silent_streams_hold_no_download_slot_and_a_members_close_unanswered(monkeypatch):
    """A stream that never sends its request held its slot with no deadline, and the state servicer
    admitted at the handler, after the request: 64 free identities with 4 silent streams each held all
    256 download slots. Now the servicer's admission is asked before the first byte, and an admitted
    stream whose first request has not arrived within FIRST_REQUEST_TIMEOUT_S is closed, freeing its slot."""
    import swarm.inbound

    monkeypatch.setattr(swarm.inbound, "FIRST_REQUEST_TIMEOUT_S", 0.5)

    async def scenario(member: bool) -> list[bytes]:
        honest, stranger, servicer = await state_pair(member=member)
        try:
            streams = [
                await stranger.call_binary_stream_handler(honest.peer_id, handle_name()) for _ in range(4)
            ]
            answers = await asyncio.gather(*(first_bytes(reader) for _, reader, _ in streams))
            for _, _, writer in streams:
                writer.close()
            return answers
        finally:
            await stranger.shutdown()
            await honest.shutdown()

    refused = asyncio.run(scenario(member=False))
    assert all(b"is not a member" in a for a in refused), refused
    silent = asyncio.run(scenario(member=True))
    assert all(b"no request arrived within" in a for a in silent), silent
