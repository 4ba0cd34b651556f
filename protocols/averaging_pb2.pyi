from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Code(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OK: _ClassVar[Code]
    BAD_GROUP: _ClassVar[Code]
    NOT_IN_GROUP: _ClassVar[Code]
    BAD_CHUNK: _ClassVar[Code]
    CANCELLED: _ClassVar[Code]
    INTERNAL: _ClassVar[Code]
    BAD_SIGNATURE: _ClassVar[Code]
    NO_EVIDENCE: _ClassVar[Code]
OK: Code
BAD_GROUP: Code
NOT_IN_GROUP: Code
BAD_CHUNK: Code
CANCELLED: Code
INTERNAL: Code
BAD_SIGNATURE: Code
NO_EVIDENCE: Code

class PartChunk(_message.Message):
    __slots__ = ("group_id", "part_index", "chunk_index", "data", "code", "error", "signature", "weight", "included", "reveal", "signed_at_ms")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    PART_INDEX_FIELD_NUMBER: _ClassVar[int]
    CHUNK_INDEX_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    INCLUDED_FIELD_NUMBER: _ClassVar[int]
    REVEAL_FIELD_NUMBER: _ClassVar[int]
    SIGNED_AT_MS_FIELD_NUMBER: _ClassVar[int]
    group_id: bytes
    part_index: int
    chunk_index: int
    data: bytes
    code: Code
    error: str
    signature: bytes
    weight: float
    included: bytes
    reveal: bytes
    signed_at_ms: int
    def __init__(self, group_id: _Optional[bytes] = ..., part_index: _Optional[int] = ..., chunk_index: _Optional[int] = ..., data: _Optional[bytes] = ..., code: _Optional[_Union[Code, str]] = ..., error: _Optional[str] = ..., signature: _Optional[bytes] = ..., weight: _Optional[float] = ..., included: _Optional[bytes] = ..., reveal: _Optional[bytes] = ..., signed_at_ms: _Optional[int] = ...) -> None: ...

class InputsRequest(_message.Message):
    __slots__ = ("group_id", "chunk_index", "part_index", "sender_index")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_INDEX_FIELD_NUMBER: _ClassVar[int]
    PART_INDEX_FIELD_NUMBER: _ClassVar[int]
    SENDER_INDEX_FIELD_NUMBER: _ClassVar[int]
    group_id: bytes
    chunk_index: int
    part_index: int
    sender_index: int
    def __init__(self, group_id: _Optional[bytes] = ..., chunk_index: _Optional[int] = ..., part_index: _Optional[int] = ..., sender_index: _Optional[int] = ...) -> None: ...

class SignedInput(_message.Message):
    __slots__ = ("sender_index", "data", "signature", "weight", "code", "error")
    SENDER_INDEX_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    sender_index: int
    data: bytes
    signature: bytes
    weight: float
    code: Code
    error: str
    def __init__(self, sender_index: _Optional[int] = ..., data: _Optional[bytes] = ..., signature: _Optional[bytes] = ..., weight: _Optional[float] = ..., code: _Optional[_Union[Code, str]] = ..., error: _Optional[str] = ...) -> None: ...

class StateRequest(_message.Message):
    __slots__ = ("run_id", "min_step", "state_hash")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    MIN_STEP_FIELD_NUMBER: _ClassVar[int]
    STATE_HASH_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    min_step: int
    state_hash: str
    def __init__(self, run_id: _Optional[str] = ..., min_step: _Optional[int] = ..., state_hash: _Optional[str] = ...) -> None: ...

class StateChunk(_message.Message):
    __slots__ = ("step", "state_hash", "total_bytes", "data", "error")
    STEP_FIELD_NUMBER: _ClassVar[int]
    STATE_HASH_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    step: int
    state_hash: str
    total_bytes: int
    data: bytes
    error: str
    def __init__(self, step: _Optional[int] = ..., state_hash: _Optional[str] = ..., total_bytes: _Optional[int] = ..., data: _Optional[bytes] = ..., error: _Optional[str] = ...) -> None: ...

class TierRequest(_message.Message):
    __slots__ = ("group_id", "attestation", "step", "attest_only")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    ATTESTATION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    ATTEST_ONLY_FIELD_NUMBER: _ClassVar[int]
    group_id: bytes
    attestation: bytes
    step: int
    attest_only: bool
    def __init__(self, group_id: _Optional[bytes] = ..., attestation: _Optional[bytes] = ..., step: _Optional[int] = ..., attest_only: _Optional[bool] = ...) -> None: ...

class TierAnswer(_message.Message):
    __slots__ = ("code", "error", "alone", "tier_group_id", "entries", "representative", "signers", "chunk")
    CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ALONE_FIELD_NUMBER: _ClassVar[int]
    TIER_GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    REPRESENTATIVE_FIELD_NUMBER: _ClassVar[int]
    SIGNERS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    code: Code
    error: str
    alone: bool
    tier_group_id: bytes
    entries: _containers.RepeatedScalarFieldContainer[bytes]
    representative: int
    signers: _containers.RepeatedScalarFieldContainer[int]
    chunk: PartChunk
    def __init__(self, code: _Optional[_Union[Code, str]] = ..., error: _Optional[str] = ..., alone: _Optional[bool] = ..., tier_group_id: _Optional[bytes] = ..., entries: _Optional[_Iterable[bytes]] = ..., representative: _Optional[int] = ..., signers: _Optional[_Iterable[int]] = ..., chunk: _Optional[_Union[PartChunk, _Mapping]] = ...) -> None: ...
