from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Header(_message.Message):
    __slots__ = ("protocol_version", "run_id")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    run_id: str
    def __init__(self, protocol_version: _Optional[int] = ..., run_id: _Optional[str] = ...) -> None: ...

class ChallengeRequest(_message.Message):
    __slots__ = ("header",)
    HEADER_FIELD_NUMBER: _ClassVar[int]
    header: Header
    def __init__(self, header: _Optional[_Union[Header, _Mapping]] = ...) -> None: ...

class ChallengeResponse(_message.Message):
    __slots__ = ("challenge", "expires_at", "coordinator_public_key", "run_id")
    CHALLENGE_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    challenge: bytes
    expires_at: float
    coordinator_public_key: bytes
    run_id: str
    def __init__(self, challenge: _Optional[bytes] = ..., expires_at: _Optional[float] = ..., coordinator_public_key: _Optional[bytes] = ..., run_id: _Optional[str] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("header", "envelope")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    ENVELOPE_FIELD_NUMBER: _ClassVar[int]
    header: Header
    envelope: bytes
    def __init__(self, header: _Optional[_Union[Header, _Mapping]] = ..., envelope: _Optional[bytes] = ...) -> None: ...

class JoinResponse(_message.Message):
    __slots__ = ("envelope",)
    ENVELOPE_FIELD_NUMBER: _ClassVar[int]
    envelope: bytes
    def __init__(self, envelope: _Optional[bytes] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("header", "envelope")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    ENVELOPE_FIELD_NUMBER: _ClassVar[int]
    header: Header
    envelope: bytes
    def __init__(self, header: _Optional[_Union[Header, _Mapping]] = ..., envelope: _Optional[bytes] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("state", "certificate", "server_time", "run_state")
    STATE_FIELD_NUMBER: _ClassVar[int]
    CERTIFICATE_FIELD_NUMBER: _ClassVar[int]
    SERVER_TIME_FIELD_NUMBER: _ClassVar[int]
    RUN_STATE_FIELD_NUMBER: _ClassVar[int]
    state: str
    certificate: bytes
    server_time: float
    run_state: bytes
    def __init__(self, state: _Optional[str] = ..., certificate: _Optional[bytes] = ..., server_time: _Optional[float] = ..., run_state: _Optional[bytes] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("header", "envelope")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    ENVELOPE_FIELD_NUMBER: _ClassVar[int]
    header: Header
    envelope: bytes
    def __init__(self, header: _Optional[_Union[Header, _Mapping]] = ..., envelope: _Optional[bytes] = ...) -> None: ...

class LeaveResponse(_message.Message):
    __slots__ = ("state",)
    STATE_FIELD_NUMBER: _ClassVar[int]
    state: str
    def __init__(self, state: _Optional[str] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ("header", "after_peer_id", "max_peers")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    AFTER_PEER_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_PEERS_FIELD_NUMBER: _ClassVar[int]
    header: Header
    after_peer_id: str
    max_peers: int
    def __init__(self, header: _Optional[_Union[Header, _Mapping]] = ..., after_peer_id: _Optional[str] = ..., max_peers: _Optional[int] = ...) -> None: ...

class PeerStatus(_message.Message):
    __slots__ = ("peer_id", "name", "state", "device", "role", "last_seen", "joined_at", "ban_reason", "metrics", "step", "param_hash", "diverged")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_FIELD_NUMBER: _ClassVar[int]
    JOINED_AT_FIELD_NUMBER: _ClassVar[int]
    BAN_REASON_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    PARAM_HASH_FIELD_NUMBER: _ClassVar[int]
    DIVERGED_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    name: str
    state: str
    device: str
    role: str
    last_seen: float
    joined_at: float
    ban_reason: str
    metrics: _containers.ScalarMap[str, float]
    step: int
    param_hash: str
    diverged: bool
    def __init__(self, peer_id: _Optional[str] = ..., name: _Optional[str] = ..., state: _Optional[str] = ..., device: _Optional[str] = ..., role: _Optional[str] = ..., last_seen: _Optional[float] = ..., joined_at: _Optional[float] = ..., ban_reason: _Optional[str] = ..., metrics: _Optional[_Mapping[str, float]] = ..., step: _Optional[int] = ..., param_hash: _Optional[str] = ..., diverged: _Optional[bool] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("protocol_version", "run_id", "coordinator_peer_id", "dht_initial_peers", "peers", "server_time", "total_peers", "next_after_peer_id", "max_steps", "checkpoint_step", "finished_step")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_PEER_ID_FIELD_NUMBER: _ClassVar[int]
    DHT_INITIAL_PEERS_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    SERVER_TIME_FIELD_NUMBER: _ClassVar[int]
    TOTAL_PEERS_FIELD_NUMBER: _ClassVar[int]
    NEXT_AFTER_PEER_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_STEPS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_STEP_FIELD_NUMBER: _ClassVar[int]
    FINISHED_STEP_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    run_id: str
    coordinator_peer_id: str
    dht_initial_peers: _containers.RepeatedScalarFieldContainer[str]
    peers: _containers.RepeatedCompositeFieldContainer[PeerStatus]
    server_time: float
    total_peers: int
    next_after_peer_id: str
    max_steps: int
    checkpoint_step: int
    finished_step: int
    def __init__(self, protocol_version: _Optional[int] = ..., run_id: _Optional[str] = ..., coordinator_peer_id: _Optional[str] = ..., dht_initial_peers: _Optional[_Iterable[str]] = ..., peers: _Optional[_Iterable[_Union[PeerStatus, _Mapping]]] = ..., server_time: _Optional[float] = ..., total_peers: _Optional[int] = ..., next_after_peer_id: _Optional[str] = ..., max_steps: _Optional[int] = ..., checkpoint_step: _Optional[int] = ..., finished_step: _Optional[int] = ...) -> None: ...

class DialBackRequest(_message.Message):
    __slots__ = ("header", "ports")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    PORTS_FIELD_NUMBER: _ClassVar[int]
    header: Header
    ports: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, header: _Optional[_Union[Header, _Mapping]] = ..., ports: _Optional[_Iterable[int]] = ...) -> None: ...

class DialBackResult(_message.Message):
    __slots__ = ("port", "reachable", "detail")
    PORT_FIELD_NUMBER: _ClassVar[int]
    REACHABLE_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    port: int
    reachable: bool
    detail: str
    def __init__(self, port: _Optional[int] = ..., reachable: _Optional[bool] = ..., detail: _Optional[str] = ...) -> None: ...

class DialBackResponse(_message.Message):
    __slots__ = ("address", "results")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    address: str
    results: _containers.RepeatedCompositeFieldContainer[DialBackResult]
    def __init__(self, address: _Optional[str] = ..., results: _Optional[_Iterable[_Union[DialBackResult, _Mapping]]] = ...) -> None: ...

class AccusationPart(_message.Message):
    __slots__ = ("header", "envelope", "evidence")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    ENVELOPE_FIELD_NUMBER: _ClassVar[int]
    EVIDENCE_FIELD_NUMBER: _ClassVar[int]
    header: Header
    envelope: bytes
    evidence: bytes
    def __init__(self, header: _Optional[_Union[Header, _Mapping]] = ..., envelope: _Optional[bytes] = ..., evidence: _Optional[bytes] = ...) -> None: ...

class AccuseResponse(_message.Message):
    __slots__ = ("verdict", "banned_peer")
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    BANNED_PEER_FIELD_NUMBER: _ClassVar[int]
    verdict: str
    banned_peer: str
    def __init__(self, verdict: _Optional[str] = ..., banned_peer: _Optional[str] = ...) -> None: ...
