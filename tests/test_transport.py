"""The averaging data path over TCP: mutual authentication, framing limits, refusals that keep it up."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import pytest
from hivemind.p2p import PeerID

from protocols import averaging_pb2 as apb
from protocols.errors import NetworkError, ProtocolError, SecurityError
from protocols.keys import SigningKey
from swarm.averaging.transport import DataPlane, announce_host, parse_address

pytestmark = pytest.mark.timeout(30)

MAX_FRAME = 1 << 16


class Echo:
    """A reducer that answers every chunk with its data reversed, and records who sent it."""

    def __init__(self):
        self.senders: list[str] = []

    async def __call__(self, stream, sender: PeerID):
        self.senders.append(sender.to_base58())
        async for message in stream:
            yield apb.PartChunk(
                part_index=message.part_index, chunk_index=message.chunk_index, data=message.data[::-1]
            )


async def outgoing(count: int):
    for i in range(count):
        yield apb.PartChunk(part_index=1, chunk_index=i, data=bytes([i]) * 100 + b"x")


async def start_pair(handler=None):
    server_key, client_key = SigningKey.generate(), SigningKey.generate()
    echo = handler or Echo()
    server = DataPlane(server_key, "run", echo, max_frame=MAX_FRAME)
    client = DataPlane(client_key, "run", Echo(), max_frame=MAX_FRAME)
    address = await server.start("127.0.0.1", 0, "127.0.0.1")
    return server, client, address, echo


def test_chunks_round_trip_between_authenticated_peers():
    async def scenario():
        server, client, address, echo = await start_pair()
        server_id = PeerID.from_base58(server.key.peer_id)
        connection = await client.connect(address, server_id, timeout_s=5)
        answers = [m async for m in connection.exchange(outgoing(5))]
        await server.close()
        return answers, echo.senders, client.key.peer_id

    answers, senders, client_id = asyncio.run(scenario())
    assert [m.chunk_index for m in answers] == list(range(5))
    assert answers[3].data == (bytes([3]) * 100 + b"x")[::-1]
    assert senders == [client_id], "the reducer learns the sender's proven peer ID"


class CarelessDataPlane(DataPlane):
    """A listener that skips checking whom the client meant to reach, as an impostor would."""

    async def _server_handshake(self, reader, writer):
        writer.write(b"swarm-ar" + bytes(32))
        await reader.readexactly(8 + 32 + 32 + 64)
        answer = self.key.sign(b"anything")
        writer.write(self.key.public_key.raw + answer)
        await writer.drain()
        return PeerID.from_base58(SigningKey.from_libp2p_bytes(b"\x08\x01\x12\x40" + bytes(64)).peer_id)


def test_a_listener_that_is_not_the_expected_peer_is_refused():
    async def scenario():
        server, client, address, _ = await start_pair()
        someone_else = PeerID.from_base58(SigningKey.generate().peer_id)
        try:
            # An honest listener hangs up on a client that signed for another peer...
            with pytest.raises(NetworkError):
                await client.connect(address, someone_else, timeout_s=5)
        finally:
            await server.close()
        # ...and a client hangs up on a listener that answers with another identity.
        impostor = CarelessDataPlane(SigningKey.generate(), "run", Echo(), max_frame=MAX_FRAME)
        address = await impostor.start("127.0.0.1", 0, "127.0.0.1")
        try:
            with pytest.raises(SecurityError, match="answered as"):
                await client.connect(address, someone_else, timeout_s=5)
        finally:
            await impostor.close()

    asyncio.run(scenario())


def test_garbage_and_oversized_frames_are_refused_and_the_listener_stays_up(caplog):
    async def scenario():
        server, client, address, echo = await start_pair()
        host, port = parse_address(address)
        # Not our protocol at all.
        reader, writer = await asyncio.open_connection(host, port)
        await reader.readexactly(8 + 32)
        writer.write(b"GET / HTTP/1.1\r\n" * 10)
        await writer.drain()
        assert await asyncio.wait_for(reader.read(), 5) == b"", "the listener hangs up on a stranger"
        writer.close()
        # Our protocol, then a frame larger than any round needs.
        server_id = PeerID.from_base58(server.key.peer_id)
        connection = await client.connect(address, server_id, timeout_s=5)

        async def huge():
            yield apb.PartChunk(part_index=1, chunk_index=0, data=b"\0" * (2 * MAX_FRAME))

        with contextlib.suppress(NetworkError):  # a reset or a plain close, as the timing goes
            assert [m async for m in connection.exchange(huge())] == []
        # Still serving others.
        connection = await client.connect(address, server_id, timeout_s=5)
        answers = [m async for m in connection.exchange(outgoing(2))]
        await server.close()
        return answers

    with caplog.at_level(logging.INFO, logger="swarm.averaging.transport"):
        answers = asyncio.run(scenario())
    assert len(answers) == 2
    assert "refused an averaging data connection" in caplog.text
    assert "not a swarm averaging data connection" in caplog.text
    assert "exceeds the round's limit" in caplog.text


def test_an_unreachable_address_fails_fast_and_is_remembered():
    async def scenario():
        client = DataPlane(SigningKey.generate(), "run", Echo(), max_frame=MAX_FRAME)
        peer = PeerID.from_base58(SigningKey.generate().peer_id)
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(NetworkError):
            await client.connect("127.0.0.1:1", peer, timeout_s=2)
        with pytest.raises(NetworkError, match="unreachable moments ago"):
            await client.connect("127.0.0.1:1", peer, timeout_s=2)
        return loop.time() - started

    assert asyncio.run(scenario()) < 3


@pytest.mark.parametrize(
    "text", ["", "host", "1.2.3.4:0", "1.2.3.4:70000", "a b:1", 17, None, "x" * 300 + ":1"]
)
def test_bad_announced_addresses_are_refused(text):
    with pytest.raises(ProtocolError, match="not host:port"):
        parse_address(text)


def test_announced_host_prefers_reachable_addresses():
    assert announce_host("10.1.2.3", ["127.0.0.1"]) == "10.1.2.3"
    assert announce_host("0.0.0.0", ["127.0.0.1", "192.168.1.5", "0.0.0.0"]) == "192.168.1.5"
    assert announce_host("0.0.0.0", ["127.0.0.1", "192.168.1.5", "11.2.3.4"]) == "11.2.3.4"
    assert announce_host("0.0.0.0", []) == "127.0.0.1"
    assert parse_address("[::1]:5000") == ("::1", 5000)
