"""A reducer keeps the inputs it aggregated after their round leaves its registry, for the coordinator's
demand (``swarm.averaging.archive``): bounded in time and bytes, shown only to members and the coordinator."""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass

import torch
from hivemind.p2p import PeerID

from protocols import averaging_pb2 as apb
from protocols.keys import SigningKey
from swarm.averaging.archive import InputArchive
from swarm.averaging.compression import get_codec
from swarm.averaging.evidence import SignedInput
from swarm.averaging.sender import PartSender
from swarm.averaging.verification import serve_inputs


@dataclass
class FinishedRound:
    """What the archive reads of a finished ``ButterflyAllReduce``."""

    group_id: bytes
    members: list[str]
    held: dict

    def aggregated_inputs(self):
        return self.held


def finished(members: list[str], nbytes: int = 1000) -> FinishedRound:
    inputs = [SignedInput(i, os.urandom(nbytes), os.urandom(64), 8.0) for i in range(len(members))]
    return FinishedRound(os.urandom(8), members, {(0, 3): inputs})


def ask(
    archive: InputArchive, group_id: bytes, asker: str, *, judge: str, sender_index: int = 1
) -> apb.SignedInput:
    request = apb.InputsRequest(group_id=group_id, part_index=0, chunk_index=3, sender_index=sender_index)

    async def first():
        async for item in serve_inputs(
            None, request, PeerID.from_base58(asker), judge=judge, archive=archive
        ):
            return item

    return asyncio.run(first())


def test_a_round_gone_from_the_registry_is_shown_to_its_members_and_the_coordinator_only():
    members = [SigningKey.generate().peer_id for _ in range(3)]
    coordinator, stranger = SigningKey.generate().peer_id, SigningKey.generate().peer_id
    archive = InputArchive()
    kept = finished(members)
    archive.keep(kept)
    shown = ask(archive, kept.group_id, coordinator, judge=coordinator)
    assert shown.code == apb.OK and shown.data == kept.held[(0, 3)][1].data
    assert ask(archive, kept.group_id, members[2], judge=coordinator).code == apb.OK
    assert ask(archive, kept.group_id, stranger, judge=coordinator).code == apb.NOT_IN_GROUP
    assert ask(archive, os.urandom(8), coordinator, judge=coordinator).code == apb.NO_EVIDENCE
    assert ask(archive, kept.group_id, coordinator, judge=coordinator, sender_index=7).code == apb.NO_EVIDENCE


def test_the_archive_is_bounded_in_time_and_bytes():
    members = [SigningKey.generate().peer_id for _ in range(3)]
    archive = InputArchive(keep_s=0.0, max_bytes=10_000)
    old = finished(members)
    archive.keep(old)
    archive.keep(finished(members))
    assert archive.lookup(old.group_id, 0, 3, 0) is None, "past keep_s a round is gone"
    archive = InputArchive(max_bytes=10_000)  # three inputs of ~1 KiB a round: three rounds fit
    rounds = [finished(members) for _ in range(4)]
    for r in rounds:
        archive.keep(r)
    assert archive.lookup(rounds[0].group_id, 0, 3, 0) is None, "the oldest goes first past the bytes"
    assert all(archive.lookup(r.group_id, 0, 3, 0) is not None for r in rounds[1:])
    assert archive.nbytes <= 10_000
    huge = finished(members, nbytes=20_000)
    archive.keep(huge)
    assert archive.lookup(huge.group_id, 0, 3, 0) is None and archive.nbytes <= 10_000


class TrimmedWhileRead:
    """What ``PartSender.own_input`` reads of a round that ``ButterflyAllReduce._trim`` trims between the
    check of its vector and the read (``serve_inputs`` runs ``own_input`` on a worker thread, the trim runs
    on the event loop): the vector is there at the first look and gone at the next, the drawn chunk kept."""

    def __init__(self, key: SigningKey, kept: SignedInput):
        self.peer_ids, self.members, self.index = [PeerID.from_base58(key.peer_id)], [key.peer_id], 0
        self.group_id, self.digest, self.weight, self.key = b"g" * 8, b"d" * 32, 8.0, key
        self.codec, self.kept_inputs, self.looks = get_codec("fp16"), {(0, 1): kept}, 0

    @property
    def local(self):
        self.looks += 1
        return torch.ones(8) if self.looks == 1 else None

    def chunk_range(self, part: int, chunk: int) -> tuple[int, int]:
        return 4 * chunk, 4 * chunk + 4

    def sign(self, message: bytes) -> bytes:
        return self.key.sign(message)


def test_an_own_input_asked_for_while_its_round_is_trimmed_is_the_kept_one():
    """A validator asking a reducer for its own input as the reducer's round trimmed itself got an error
    (the vector read as None halfway), and the reducer looked as if it would not show what it signed for."""
    key = SigningKey.generate()
    kept = SignedInput(0, b"kept", b"signature", 8.0)
    round = TrimmedWhileRead(key, kept)
    assert PartSender(round).own_input(0, 1) == kept
    assert round.looks >= 2, "the vector was there at the check and gone at the read"
