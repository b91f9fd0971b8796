from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Empty(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("host", "local_rank", "min_generation", "timeout_ms", "rank", "size", "process")
    HOST_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    MIN_GENERATION_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    PROCESS_FIELD_NUMBER: _ClassVar[int]
    host: str
    local_rank: int
    min_generation: int
    timeout_ms: int
    rank: int
    size: int
    process: str
    def __init__(self, host: _Optional[str] = ..., local_rank: _Optional[int] = ..., min_generation: _Optional[int] = ..., timeout_ms: _Optional[int] = ..., rank: _Optional[int] = ..., size: _Optional[int] = ..., process: _Optional[str] = ...) -> None: ...

class RankInfo(_message.Message):
    __slots__ = ("rank", "size", "local_rank", "local_size", "cross_rank", "cross_size", "generation")
    RANK_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    LOCAL_SIZE_FIELD_NUMBER: _ClassVar[int]
    CROSS_RANK_FIELD_NUMBER: _ClassVar[int]
    CROSS_SIZE_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    generation: int
    def __init__(self, rank: _Optional[int] = ..., size: _Optional[int] = ..., local_rank: _Optional[int] = ..., local_size: _Optional[int] = ..., cross_rank: _Optional[int] = ..., cross_size: _Optional[int] = ..., generation: _Optional[int] = ...) -> None: ...

class SetRequest(_message.Message):
    __slots__ = ("key", "value")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    key: str
    value: bytes
    def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("key", "timeout_ms", "read_ahead")
    KEY_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    READ_AHEAD_FIELD_NUMBER: _ClassVar[int]
    key: str
    timeout_ms: int
    read_ahead: int
    def __init__(self, key: _Optional[str] = ..., timeout_ms: _Optional[int] = ..., read_ahead: _Optional[int] = ...) -> None: ...

class GetResponse(_message.Message):
    __slots__ = ("value", "ahead")
    VALUE_FIELD_NUMBER: _ClassVar[int]
    AHEAD_FIELD_NUMBER: _ClassVar[int]
    value: bytes
    ahead: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, value: _Optional[bytes] = ..., ahead: _Optional[_Iterable[bytes]] = ...) -> None: ...

class WaitRequest(_message.Message):
    __slots__ = ("keys", "timeout_ms")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    timeout_ms: int
    def __init__(self, keys: _Optional[_Iterable[str]] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class AddRequest(_message.Message):
    __slots__ = ("key", "amount")
    KEY_FIELD_NUMBER: _ClassVar[int]
    AMOUNT_FIELD_NUMBER: _ClassVar[int]
    key: str
    amount: int
    def __init__(self, key: _Optional[str] = ..., amount: _Optional[int] = ...) -> None: ...

class AddResponse(_message.Message):
    __slots__ = ("value",)
    VALUE_FIELD_NUMBER: _ClassVar[int]
    value: int
    def __init__(self, value: _Optional[int] = ...) -> None: ...

class CompareSetRequest(_message.Message):
    __slots__ = ("key", "expected", "desired")
    KEY_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_FIELD_NUMBER: _ClassVar[int]
    DESIRED_FIELD_NUMBER: _ClassVar[int]
    key: str
    expected: bytes
    desired: bytes
    def __init__(self, key: _Optional[str] = ..., expected: _Optional[bytes] = ..., desired: _Optional[bytes] = ...) -> None: ...

class CheckRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, keys: _Optional[_Iterable[str]] = ...) -> None: ...

class CheckResponse(_message.Message):
    __slots__ = ("ready",)
    READY_FIELD_NUMBER: _ClassVar[int]
    ready: bool
    def __init__(self, ready: _Optional[bool] = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: str
    def __init__(self, key: _Optional[str] = ...) -> None: ...

class DeleteResponse(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: bool
    def __init__(self, deleted: _Optional[bool] = ...) -> None: ...

class NumKeysResponse(_message.Message):
    __slots__ = ("count",)
    COUNT_FIELD_NUMBER: _ClassVar[int]
    count: int
    def __init__(self, count: _Optional[int] = ...) -> None: ...

class BarrierRequest(_message.Message):
    __slots__ = ("name", "participants", "timeout_ms")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PARTICIPANTS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    name: str
    participants: int
    timeout_ms: int
    def __init__(self, name: _Optional[str] = ..., participants: _Optional[int] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ("rank",)
    RANK_FIELD_NUMBER: _ClassVar[int]
    rank: int
    def __init__(self, rank: _Optional[int] = ...) -> None: ...

class WatchEvent(_message.Message):
    __slots__ = ("kind", "message", "generation", "roll_call")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        HEARTBEAT: _ClassVar[WatchEvent.Kind]
        SHUTDOWN: _ClassVar[WatchEvent.Kind]
        HOSTS_UPDATED: _ClassVar[WatchEvent.Kind]
    HEARTBEAT: WatchEvent.Kind
    SHUTDOWN: WatchEvent.Kind
    HOSTS_UPDATED: WatchEvent.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    ROLL_CALL_FIELD_NUMBER: _ClassVar[int]
    kind: WatchEvent.Kind
    message: str
    generation: int
    roll_call: int
    def __init__(self, kind: _Optional[_Union[WatchEvent.Kind, str]] = ..., message: _Optional[str] = ..., generation: _Optional[int] = ..., roll_call: _Optional[int] = ...) -> None: ...

class RegisterHostRequest(_message.Message):
    __slots__ = ("host", "local_ranks", "min_generation", "timeout_ms")
    HOST_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANKS_FIELD_NUMBER: _ClassVar[int]
    MIN_GENERATION_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    host: str
    local_ranks: _containers.RepeatedScalarFieldContainer[int]
    min_generation: int
    timeout_ms: int
    def __init__(self, host: _Optional[str] = ..., local_ranks: _Optional[_Iterable[int]] = ..., min_generation: _Optional[int] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class RegisterHostResponse(_message.Message):
    __slots__ = ("ranks",)
    RANKS_FIELD_NUMBER: _ClassVar[int]
    ranks: _containers.RepeatedCompositeFieldContainer[RankInfo]
    def __init__(self, ranks: _Optional[_Iterable[_Union[RankInfo, _Mapping]]] = ...) -> None: ...

class WatchHostRequest(_message.Message):
    __slots__ = ("ranks",)
    RANKS_FIELD_NUMBER: _ClassVar[int]
    ranks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ranks: _Optional[_Iterable[int]] = ...) -> None: ...

class MultiGetRequest(_message.Message):
    __slots__ = ("keys", "timeout_ms")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    timeout_ms: int
    def __init__(self, keys: _Optional[_Iterable[str]] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class MultiGetResponse(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, values: _Optional[_Iterable[bytes]] = ...) -> None: ...

class MultiSetRequest(_message.Message):
    __slots__ = ("keys", "values")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    values: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, keys: _Optional[_Iterable[str]] = ..., values: _Optional[_Iterable[bytes]] = ...) -> None: ...
