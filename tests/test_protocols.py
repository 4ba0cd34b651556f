"""The wire layer: canonical msgpack with limits, Ed25519 peer IDs, signed envelopes, certificates, bodies."""

from __future__ import annotations

import math

import msgpack
import pytest

from protocols.certificates import CERTIFICATE_PURPOSE, issue_certificate, verify_certificate
from protocols.codec import pack, unpack
from protocols.envelope import MAX_CLOCK_SKEW_S, open_envelope, seal
from protocols.errors import (
    CertificateError,
    IdentityError,
    MessageTooLarge,
    ProtocolError,
    ReplayError,
    SignatureError,
)
from protocols.keys import PublicKey, SigningKey
from protocols.messages import (
    CHALLENGE_BYTES,
    HEARTBEAT,
    JOIN,
    MAX_METRICS,
    MAX_SUSPECT_REPORTS,
    HeartbeatBody,
    JoinBody,
    LeaveBody,
    parse_body,
    token_proof,
)
from protocols.version import MAX_ENVELOPE_BYTES, MAX_NESTING_DEPTH

pytestmark = pytest.mark.timeout(60)

RUN = "test-run"
T0 = 1_700_000_000.0
# A real CIDv0-style (sha256 multihash) peer ID, as RSA keys get: it does not embed its public key.
RSA_STYLE_PEER_ID = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"


@pytest.fixture(scope="module")
def alice() -> SigningKey:
    return SigningKey.generate()


@pytest.fixture(scope="module")
def mallory() -> SigningKey:
    return SigningKey.generate()


def _nested_list(depth: int) -> object:
    value: object = 0
    for _ in range(depth):
        value = [value]
    return value


# codec


def test_pack_is_canonical_whatever_the_key_order() -> None:
    first = {"b": 1, "a": {"y": [1, 2, {"q": b"\x00", "p": None}], "x": 2.5}, "c": "text"}
    second = {"c": "text", "a": {"x": 2.5, "y": [1, 2, {"p": None, "q": b"\x00"}]}, "b": 1}
    assert list(first) != list(second)
    assert pack(first) == pack(second)


def test_pack_unpack_round_trip_keeps_bytes_and_str_apart() -> None:
    data = {"s": "abc", "b": b"abc", "n": -3, "f": 0.1, "t": True, "none": None, "l": [1, "2", b"3"]}
    assert unpack(pack(data)) == data
    assert isinstance(unpack(pack(data))["b"], bytes)


def test_pack_refuses_non_string_keys_and_unknown_types() -> None:
    with pytest.raises(ProtocolError, match="map keys must be strings"):
        pack({1: "x"})
    with pytest.raises(ProtocolError, match="set"):
        pack({"s": {1, 2}})


@pytest.mark.parametrize("value", ["\udcff", 2**64], ids=["lone-surrogate", "int-over-64-bits"])
def test_pack_translates_unencodable_values_into_protocol_error(value: object) -> None:
    # A --name given as non-UTF-8 bytes on Linux arrives surrogate-escaped; it must not crash with a traceback.
    with pytest.raises(ProtocolError):
        pack({"name": value})


def test_unpack_refuses_oversized_input_and_names_the_limit() -> None:
    with pytest.raises(MessageTooLarge, match=str(MAX_ENVELOPE_BYTES)):
        unpack(b"\xc0" * (MAX_ENVELOPE_BYTES + 1))
    with pytest.raises(MessageTooLarge, match=r"heartbeat is 11 bytes; the limit is 10"):
        unpack(pack("0123456789"), max_bytes=10, what="heartbeat")


@pytest.mark.parametrize(
    "data",
    [msgpack.packb(msgpack.ExtType(5, b"xyz")), msgpack.packb(msgpack.Timestamp(1, 0))],
    ids=["ext-type", "timestamp-ext"],
)
def test_unpack_refuses_msgpack_extension_types(data: bytes) -> None:
    with pytest.raises(ProtocolError, match="ext"):
        unpack(data)


def test_unpack_refuses_integer_map_keys() -> None:
    with pytest.raises(ProtocolError, match="malformed message"):
        unpack(msgpack.packb({1: "x"}))


def test_unpack_refuses_bytes_map_keys() -> None:
    # The codec promises string-keyed maps only; msgpack's strict_map_key still lets bytes keys through.
    data = msgpack.packb({"body": {b"seq": 1}}, use_bin_type=True)
    with pytest.raises(ProtocolError):
        unpack(data)


def test_unpack_refuses_nesting_deeper_than_the_limit() -> None:
    at_limit = _nested_list(MAX_NESTING_DEPTH)
    assert unpack(msgpack.packb(at_limit)) == at_limit
    with pytest.raises(ProtocolError, match=f"deeper than {MAX_NESTING_DEPTH}"):
        unpack(msgpack.packb(_nested_list(MAX_NESTING_DEPTH + 1)))
    # Far deeper than msgpack's own stack: still a ProtocolError, never a crash.
    with pytest.raises(ProtocolError):
        unpack(b"\x91" * 5000 + b"\x00")


@pytest.mark.parametrize(
    "data",
    [pack({"a": "hello"})[:-2], b"", b"\xc1", pack(1) + b"\x00", b"\x81\xa1a"],
    ids=["truncated", "empty", "reserved-byte", "trailing-bytes", "map-without-value"],
)
def test_unpack_refuses_truncated_or_garbage_bytes(data: bytes) -> None:
    with pytest.raises(ProtocolError, match="malformed join request"):
        unpack(data, what="join request")


def test_unpack_refuses_non_bytes() -> None:
    with pytest.raises(ProtocolError, match="must be bytes"):
        unpack("not bytes")  # type: ignore[arg-type]


# keys


def test_peer_id_matches_hivemind_for_the_same_key_file(tmp_path) -> None:
    import hivemind

    key = SigningKey.generate()
    identity = tmp_path / "identity.key"
    identity.write_bytes(key.to_libp2p_bytes())
    dht = hivemind.DHT(
        start=True,
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        identity_path=str(identity),
        check_if_identity_free=False,
    )
    try:
        assert dht.peer_id.to_base58() == key.peer_id
    finally:
        dht.shutdown()


def test_public_key_round_trips_through_its_peer_id(alice: SigningKey) -> None:
    assert alice.peer_id.startswith("12D3KooW")
    recovered = PublicKey.from_peer_id(alice.peer_id)
    assert recovered == alice.public_key
    assert recovered.peer_id == alice.peer_id


@pytest.mark.parametrize(
    ("peer_id", "reason"),
    [
        (RSA_STYLE_PEER_ID, "does not embed an Ed25519 public key"),
        ("12D3KooW", "does not embed an Ed25519 public key"),
        ("not-a-peer-id!0OIl", "is not base58"),
        ("", "does not embed"),
        (None, "is not base58"),
    ],
)
def test_from_peer_id_refuses_ids_without_an_ed25519_key(peer_id: object, reason: str) -> None:
    with pytest.raises(ProtocolError, match=reason):
        PublicKey.from_peer_id(peer_id)  # type: ignore[arg-type]


def test_verify_refuses_another_keys_signature_and_flipped_bits(
    alice: SigningKey, mallory: SigningKey
) -> None:
    data = b"step 42: loss 3.14"
    signature = alice.sign(data)
    alice.public_key.verify(signature, data)
    with pytest.raises(SignatureError, match=alice.peer_id):
        alice.public_key.verify(mallory.sign(data), data)
    flipped_signature = bytes([signature[0] ^ 1]) + signature[1:]
    with pytest.raises(SignatureError, match="does not verify"):
        alice.public_key.verify(flipped_signature, data)
    with pytest.raises(SignatureError, match="does not verify"):
        alice.public_key.verify(signature, bytes([data[0] ^ 0x80]) + data[1:])
    with pytest.raises(SignatureError, match="not 64 bytes"):
        alice.public_key.verify(signature[:-1], data)


def test_libp2p_key_bytes_round_trip(alice: SigningKey) -> None:
    encoded = alice.to_libp2p_bytes()
    assert len(encoded) == 68 and encoded[:4] == bytes([0x08, 0x01, 0x12, 0x40])
    restored = SigningKey.from_libp2p_bytes(encoded)
    assert restored.peer_id == alice.peer_id
    alice.public_key.verify(restored.sign(b"x"), b"x")


def test_from_libp2p_bytes_refuses_truncated_and_mismatched_files(
    alice: SigningKey, mallory: SigningKey
) -> None:
    encoded = alice.to_libp2p_bytes()
    with pytest.raises(IdentityError, match="68 bytes"):
        SigningKey.from_libp2p_bytes(encoded[:-1])
    with pytest.raises(IdentityError, match="libp2p format"):
        SigningKey.from_libp2p_bytes(b"\x08\x00\x12\x40" + encoded[4:])
    mismatched = encoded[:36] + mallory.public_key.raw
    with pytest.raises(IdentityError, match="public half does not match"):
        SigningKey.from_libp2p_bytes(mismatched)


# envelope


def test_open_envelope_round_trip(alice: SigningKey) -> None:
    body = {"seq": 7, "state": "online", "metrics": {"loss": 2.5}}
    data = seal(alice, HEARTBEAT, RUN, body, now=T0)
    envelope = open_envelope(
        data, purpose=HEARTBEAT, run_id=RUN, signer=alice.public_key, max_age_s=30, now=T0 + 1
    )
    assert envelope.body == body
    assert envelope.sender == alice.peer_id
    assert (envelope.purpose, envelope.run_id, envelope.issued_at) == (HEARTBEAT, RUN, T0)
    assert envelope.encoded == data


def test_open_envelope_refuses_wrong_purpose(alice: SigningKey) -> None:
    data = seal(alice, HEARTBEAT, RUN, {}, now=T0)
    with pytest.raises(ProtocolError, match=f"is for '{HEARTBEAT}', expected '{JOIN}'") as info:
        open_envelope(data, purpose=JOIN, run_id=RUN)
    assert alice.peer_id in str(info.value)


def test_open_envelope_refuses_another_run_and_names_both(alice: SigningKey) -> None:
    data = seal(alice, HEARTBEAT, "other-run", {}, now=T0)
    with pytest.raises(ProtocolError, match=f"for run 'other-run', expected '{RUN}'"):
        open_envelope(data, purpose=HEARTBEAT, run_id=RUN)


def test_open_envelope_refuses_a_tampered_payload(alice: SigningKey) -> None:
    data = seal(alice, HEARTBEAT, RUN, {"reason": "honest"}, now=T0)
    tampered = data.replace(b"honest", b"hacked")
    assert tampered != data and len(tampered) == len(data)
    with pytest.raises(SignatureError, match="does not verify"):
        open_envelope(tampered, purpose=HEARTBEAT, run_id=RUN)


def test_open_envelope_refuses_signer_substitution(alice: SigningKey, mallory: SigningKey) -> None:
    by_mallory = seal(mallory, HEARTBEAT, RUN, {}, now=T0)
    with pytest.raises(SignatureError, match=f"signed by {mallory.peer_id}, expected {alice.peer_id}"):
        open_envelope(by_mallory, purpose=HEARTBEAT, run_id=RUN, signer=alice.public_key)
    # Claiming Alice as signer while keeping Mallory's signature does not verify either.
    outer = unpack(by_mallory)
    inner = unpack(outer["payload"])
    inner["signer"] = alice.public_key.raw
    forged = pack({"payload": pack(inner), "sig": outer["sig"]})
    with pytest.raises(SignatureError, match=f"does not verify for {alice.peer_id}"):
        open_envelope(forged, purpose=HEARTBEAT, run_id=RUN, signer=alice.public_key)


def test_open_envelope_refuses_stale_messages(alice: SigningKey) -> None:
    data = seal(alice, HEARTBEAT, RUN, {}, now=T0)
    open_envelope(data, purpose=HEARTBEAT, run_id=RUN, max_age_s=30, now=T0 + 29)
    with pytest.raises(ReplayError, match=r"is 31s old \(limit 30s\)") as info:
        open_envelope(data, purpose=HEARTBEAT, run_id=RUN, max_age_s=30, now=T0 + 31)
    assert alice.peer_id in str(info.value)


def test_open_envelope_refuses_messages_from_the_future(alice: SigningKey) -> None:
    data = seal(alice, HEARTBEAT, RUN, {}, now=T0)
    open_envelope(data, purpose=HEARTBEAT, run_id=RUN, max_age_s=30, now=T0 - MAX_CLOCK_SKEW_S + 1)
    with pytest.raises(ReplayError, match="in the future"):
        open_envelope(data, purpose=HEARTBEAT, run_id=RUN, max_age_s=30, now=T0 - MAX_CLOCK_SKEW_S - 1)


def test_open_envelope_refuses_a_non_finite_timestamp(alice: SigningKey) -> None:
    data = seal(alice, HEARTBEAT, RUN, {}, now=math.inf)
    with pytest.raises(ProtocolError, match="non-finite timestamp"):
        open_envelope(data, purpose=HEARTBEAT, run_id=RUN)


def test_open_envelope_refuses_malformed_outer_layers(alice: SigningKey) -> None:
    with pytest.raises(ProtocolError, match="heartbeat is not a map"):
        open_envelope(pack([1, 2]), purpose=HEARTBEAT, run_id=RUN, what="heartbeat")
    with pytest.raises(ProtocolError, match="field 'sig' is missing"):
        open_envelope(pack({"payload": b"x"}), purpose=HEARTBEAT, run_id=RUN)
    signed = alice.sign(b"irrelevant")
    with pytest.raises(ProtocolError, match="payload is not a map"):
        open_envelope(pack({"payload": pack("x"), "sig": signed}), purpose=HEARTBEAT, run_id=RUN)


# certificates


def _certificate(coordinator: SigningKey, peer: SigningKey, **overrides: object) -> bytes:
    kwargs: dict = {
        "public_key": peer.public_key,
        "run_id": RUN,
        "role": "trainer",
        "name": "box",
        "serial": 1,
    }
    kwargs.update(ttl_s=3600.0, now=T0)
    kwargs.update(overrides)
    return issue_certificate(coordinator, **kwargs).encoded


def test_certificate_issue_and_verify(alice: SigningKey, mallory: SigningKey) -> None:
    coordinator = alice
    data = _certificate(coordinator, mallory, serial=9)
    cert = verify_certificate(data, issuer=coordinator.public_key, run_id=RUN, now=T0 + 10)
    assert cert.peer_id == mallory.peer_id
    assert cert.public_key == mallory.public_key
    assert (cert.run_id, cert.role, cert.name, cert.serial) == (RUN, "trainer", "box", 9)
    assert cert.expires_at == T0 + 3600.0
    assert cert.expires_in(now=T0 + 600) == 3000.0
    assert cert.issuer == coordinator.public_key


def test_forged_certificate_is_refused(alice: SigningKey, mallory: SigningKey) -> None:
    forged = _certificate(mallory, mallory)
    with pytest.raises(CertificateError, match="not by this run's coordinator") as info:
        verify_certificate(forged, issuer=alice.public_key, run_id=RUN, now=T0)
    assert mallory.peer_id in str(info.value) and alice.peer_id in str(info.value)


def test_expired_certificate_is_refused(alice: SigningKey, mallory: SigningKey) -> None:
    data = _certificate(alice, mallory, ttl_s=60.0)
    verify_certificate(data, issuer=alice.public_key, run_id=RUN, now=T0 + 59)
    with pytest.raises(CertificateError, match=f"certificate of {mallory.peer_id} expired 5s ago"):
        verify_certificate(data, issuer=alice.public_key, run_id=RUN, now=T0 + 65)


def test_certificate_for_another_run_is_refused(alice: SigningKey, mallory: SigningKey) -> None:
    data = _certificate(alice, mallory, run_id="other-run")
    with pytest.raises(CertificateError, match="run 'other-run', expected 'test-run'"):
        verify_certificate(data, issuer=alice.public_key, run_id=RUN, now=T0)


def test_certificate_whose_peer_id_does_not_match_its_key_is_refused(
    alice: SigningKey, mallory: SigningKey
) -> None:
    body = {
        "peer_id": alice.peer_id,
        "public_key": mallory.public_key.raw,
        "role": "trainer",
        "name": "box",
        "serial": 1,
        "expires_at": T0 + 3600,
    }
    data = seal(alice, CERTIFICATE_PURPOSE, RUN, body, now=T0)
    with pytest.raises(CertificateError, match="peer ID does not match its public key"):
        verify_certificate(data, issuer=alice.public_key, run_id=RUN, now=T0)


def test_certificate_with_a_tampered_byte_is_refused(alice: SigningKey, mallory: SigningKey) -> None:
    data = _certificate(alice, mallory, role="data")
    tampered = data.replace(b"\xa4data", b"\xa4stag")
    assert tampered != data
    with pytest.raises(CertificateError, match="invalid certificate"):
        verify_certificate(tampered, issuer=alice.public_key, run_id=RUN, now=T0)


def test_certificate_with_a_nan_expiry_is_refused(alice: SigningKey, mallory: SigningKey) -> None:
    # NaN compares false with everything, so a NaN expiry would make a certificate that never expires.
    body = {
        "peer_id": mallory.peer_id,
        "public_key": mallory.public_key.raw,
        "role": "trainer",
        "name": "box",
        "serial": 1,
        "expires_at": math.nan,
    }
    data = seal(alice, CERTIFICATE_PURPOSE, RUN, body, now=T0)
    with pytest.raises(CertificateError, match="expir"):
        verify_certificate(data, issuer=alice.public_key, run_id=RUN, now=T0 + 10 * 365 * 86400)


# messages

SENDER = "12D3KooWSender"


@pytest.mark.parametrize(
    ("model", "body", "field", "reason"),
    [
        (
            JoinBody,
            {"challenge": b"c" * CHALLENGE_BYTES, "name": "box", "device": "cpu", "role": "boss"},
            "role",
            "'auto', 'data', 'stage' or 'trainer'",
        ),
        (
            HeartbeatBody,
            {"seq": 1, "state": "online", "metrics": {"loss": math.nan}},
            "metrics",
            "'loss' is not a finite",
        ),
        (
            HeartbeatBody,
            {"seq": 1, "state": "online", "metrics": {"loss": math.inf}},
            "metrics",
            "not a finite",
        ),
        (
            HeartbeatBody,
            {"seq": 1, "state": "online", "metrics": {f"m{i}": 1.0 for i in range(MAX_METRICS + 1)}},
            "metrics",
            f"at most {MAX_METRICS} items",
        ),
        (
            HeartbeatBody,
            {"seq": 1, "state": "online", "admin": True},
            "admin",
            "Extra inputs are not permitted",
        ),
        (HeartbeatBody, {"seq": 1, "state": "online", "suspects": ["not/a peer"]}, "suspects.0", "pattern"),
        (
            HeartbeatBody,
            {"seq": 1, "state": "online", "suspects": ["Qm1"] * (MAX_SUSPECT_REPORTS + 1)},
            "suspects",
            f"at most {MAX_SUSPECT_REPORTS} items",
        ),
        (HeartbeatBody, {"seq": "1", "state": "online"}, "seq", "valid integer"),
        (HeartbeatBody, {"seq": True, "state": "online"}, "seq", "valid integer"),
        (HeartbeatBody, {"seq": 0, "state": "online"}, "seq", "greater than 0"),
        (LeaveBody, {"seq": 1, "reason": "x" * 257}, "reason", "at most 256"),
        (
            JoinBody,
            {"challenge": b"short", "name": "box", "device": "cpu", "role": "auto"},
            "challenge",
            "at least 32",
        ),
        (
            JoinBody,
            {"challenge": b"c" * 32, "name": "a\nb", "device": "cpu", "role": "auto"},
            "name",
            "pattern",
        ),
    ],
    ids=[
        "bad-role",
        "nan-metric",
        "inf-metric",
        "too-many-metrics",
        "unknown-field",
        "bad-suspect",
        "too-many-suspects",
        "str-seq",
        "bool-seq",
        "zero-seq",
        "long-reason",
        "short-challenge",
        "control-char-name",
    ],
)
def test_parse_body_errors_name_the_field_and_the_sender(
    model: type, body: dict, field: str, reason: str
) -> None:
    with pytest.raises(ProtocolError) as info:
        parse_body(model, body, sender=SENDER, what="message")
    message = str(info.value)
    assert f"message from {SENDER}" in message
    assert f"field '{field}'" in message
    assert reason in message


def test_parse_body_accepts_a_valid_heartbeat() -> None:
    body = parse_body(
        HeartbeatBody,
        {"seq": 3, "state": "paused", "metrics": {"loss": 1.5, "step": 2}},
        sender=SENDER,
        what="hb",
    )
    assert (body.seq, body.state, body.metrics) == (3, "paused", {"loss": 1.5, "step": 2.0})


def test_token_proof_is_bound_to_the_challenge_the_key_and_the_token(
    alice: SigningKey, mallory: SigningKey
) -> None:
    challenge_a, challenge_b = b"a" * CHALLENGE_BYTES, b"b" * CHALLENGE_BYTES
    proof = token_proof("s3cret", challenge_a, alice.public_key.raw)
    assert len(proof) == 32
    assert proof == token_proof("s3cret", challenge_a, alice.public_key.raw)
    assert proof != token_proof("s3cret", challenge_b, alice.public_key.raw)
    assert proof != token_proof("s3cret", challenge_a, mallory.public_key.raw)
    assert proof != token_proof("other", challenge_a, alice.public_key.raw)
    assert b"s3cret" not in proof
