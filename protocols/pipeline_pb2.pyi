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
    BAD_REQUEST: _ClassVar[Code]
    UNKNOWN_PEER: _ClassVar[Code]
    BANNED: _ClassVar[Code]
    WRONG_STEP: _ClassVar[Code]
    UNKNOWN_MICROBATCH: _ClassVar[Code]
    BUSY: _ClassVar[Code]
    INTERNAL: _ClassVar[Code]

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSET: _ClassVar[DType]
    FLOAT16: _ClassVar[DType]
    FLOAT32: _ClassVar[DType]
    INT64: _ClassVar[DType]
OK: Code
BAD_REQUEST: Code
UNKNOWN_PEER: Code
BANNED: Code
WRONG_STEP: Code
UNKNOWN_MICROBATCH: Code
BUSY: Code
INTERNAL: Code
DTYPE_UNSET: DType
FLOAT16: DType
FLOAT32: DType
INT64: DType

class Tensor(_message.Message):
    __slots__ = ("shape", "dtype", "data")
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: DType
    data: bytes
    def __init__(self, shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[_Union[DType, str]] = ..., data: _Optional[bytes] = ...) -> None: ...

class ForwardRequest(_message.Message):
    __slots__ = ("run_id", "stage", "step", "microbatch_id", "inputs", "targets", "inference", "attempt", "attempt_signature")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_ID_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    INFERENCE_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    stage: int
    step: int
    microbatch_id: int
    inputs: Tensor
    targets: Tensor
    inference: bool
    attempt: int
    attempt_signature: bytes
    def __init__(self, run_id: _Optional[str] = ..., stage: _Optional[int] = ..., step: _Optional[int] = ..., microbatch_id: _Optional[int] = ..., inputs: _Optional[_Union[Tensor, _Mapping]] = ..., targets: _Optional[_Union[Tensor, _Mapping]] = ..., inference: _Optional[bool] = ..., attempt: _Optional[int] = ..., attempt_signature: _Optional[bytes] = ...) -> None: ...

class ForwardReply(_message.Message):
    __slots__ = ("code", "error", "step", "outputs", "grad_inputs", "loss", "state_hash", "signature")
    CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    GRAD_INPUTS_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    STATE_HASH_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    code: Code
    error: str
    step: int
    outputs: Tensor
    grad_inputs: Tensor
    loss: float
    state_hash: str
    signature: bytes
    def __init__(self, code: _Optional[_Union[Code, str]] = ..., error: _Optional[str] = ..., step: _Optional[int] = ..., outputs: _Optional[_Union[Tensor, _Mapping]] = ..., grad_inputs: _Optional[_Union[Tensor, _Mapping]] = ..., loss: _Optional[float] = ..., state_hash: _Optional[str] = ..., signature: _Optional[bytes] = ...) -> None: ...

class BackwardRequest(_message.Message):
    __slots__ = ("run_id", "stage", "step", "microbatch_id", "grad_outputs", "attempt", "attempt_signature")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_ID_FIELD_NUMBER: _ClassVar[int]
    GRAD_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    stage: int
    step: int
    microbatch_id: int
    grad_outputs: Tensor
    attempt: int
    attempt_signature: bytes
    def __init__(self, run_id: _Optional[str] = ..., stage: _Optional[int] = ..., step: _Optional[int] = ..., microbatch_id: _Optional[int] = ..., grad_outputs: _Optional[_Union[Tensor, _Mapping]] = ..., attempt: _Optional[int] = ..., attempt_signature: _Optional[bytes] = ...) -> None: ...

class BackwardReply(_message.Message):
    __slots__ = ("code", "error", "step", "grad_inputs", "state_hash", "signature")
    CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    GRAD_INPUTS_FIELD_NUMBER: _ClassVar[int]
    STATE_HASH_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    code: Code
    error: str
    step: int
    grad_inputs: Tensor
    state_hash: str
    signature: bytes
    def __init__(self, code: _Optional[_Union[Code, str]] = ..., error: _Optional[str] = ..., step: _Optional[int] = ..., grad_inputs: _Optional[_Union[Tensor, _Mapping]] = ..., state_hash: _Optional[str] = ..., signature: _Optional[bytes] = ...) -> None: ...
