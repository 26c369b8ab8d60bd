from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SnapshotRequest(_message.Message):
    __slots__ = ("replica_id", "max_entries")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    max_entries: int
    def __init__(self, replica_id: _Optional[str] = ..., max_entries: _Optional[int] = ...) -> None: ...

class SnapshotPart(_message.Message):
    __slots__ = ("endpoint_id", "writes", "roots", "stored")
    ENDPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    WRITES_FIELD_NUMBER: _ClassVar[int]
    ROOTS_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    endpoint_id: str
    writes: _containers.RepeatedCompositeFieldContainer[Record]
    roots: _containers.RepeatedScalarFieldContainer[int]
    stored: _containers.RepeatedCompositeFieldContainer[StoredObject]
    def __init__(self, endpoint_id: _Optional[str] = ..., writes: _Optional[_Iterable[_Union[Record, _Mapping]]] = ..., roots: _Optional[_Iterable[int]] = ..., stored: _Optional[_Iterable[_Union[StoredObject, _Mapping]]] = ...) -> None: ...

class SubscribeRequest(_message.Message):
    __slots__ = ("replica_id",)
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    def __init__(self, replica_id: _Optional[str] = ...) -> None: ...

class RecordBatch(_message.Message):
    __slots__ = ("replica_id", "records", "dropped", "observations", "prefill", "prefill_snapshot", "stored")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    OBSERVATIONS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    records: _containers.RepeatedCompositeFieldContainer[Record]
    dropped: int
    observations: _containers.RepeatedCompositeFieldContainer[Observation]
    prefill: _containers.RepeatedCompositeFieldContainer[PrefillLoad]
    prefill_snapshot: bool
    stored: _containers.RepeatedCompositeFieldContainer[StoredObject]
    def __init__(self, replica_id: _Optional[str] = ..., records: _Optional[_Iterable[_Union[Record, _Mapping]]] = ..., dropped: _Optional[int] = ..., observations: _Optional[_Iterable[_Union[Observation, _Mapping]]] = ..., prefill: _Optional[_Iterable[_Union[PrefillLoad, _Mapping]]] = ..., prefill_snapshot: _Optional[bool] = ..., stored: _Optional[_Iterable[_Union[StoredObject, _Mapping]]] = ...) -> None: ...

class StoredObject(_message.Message):
    __slots__ = ("id", "endpoint_id", "age_s")
    ID_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    AGE_S_FIELD_NUMBER: _ClassVar[int]
    id: str
    endpoint_id: str
    age_s: float
    def __init__(self, id: _Optional[str] = ..., endpoint_id: _Optional[str] = ..., age_s: _Optional[float] = ...) -> None: ...

class PrefillLoad(_message.Message):
    __slots__ = ("endpoint_id", "tokens")
    ENDPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    endpoint_id: str
    tokens: float
    def __init__(self, endpoint_id: _Optional[str] = ..., tokens: _Optional[float] = ...) -> None: ...

class Observation(_message.Message):
    __slots__ = ("token", "kind", "age_s", "first_bytes_age_s", "status", "prompt_tokens", "cached_tokens", "completion_tokens", "response_bytes", "generated_text", "stored_ids")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        CLAIMED: _ClassVar[Observation.Kind]
        FIRST_BYTES: _ClassVar[Observation.Kind]
        FINISHED: _ClassVar[Observation.Kind]
        ENDED: _ClassVar[Observation.Kind]
    CLAIMED: Observation.Kind
    FIRST_BYTES: Observation.Kind
    FINISHED: Observation.Kind
    ENDED: Observation.Kind
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    AGE_S_FIELD_NUMBER: _ClassVar[int]
    FIRST_BYTES_AGE_S_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_BYTES_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TEXT_FIELD_NUMBER: _ClassVar[int]
    STORED_IDS_FIELD_NUMBER: _ClassVar[int]
    token: str
    kind: Observation.Kind
    age_s: float
    first_bytes_age_s: float
    status: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    response_bytes: int
    generated_text: str
    stored_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, token: _Optional[str] = ..., kind: _Optional[_Union[Observation.Kind, str]] = ..., age_s: _Optional[float] = ..., first_bytes_age_s: _Optional[float] = ..., status: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., response_bytes: _Optional[int] = ..., generated_text: _Optional[str] = ..., stored_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class Record(_message.Message):
    __slots__ = ("endpoint_id", "hashes", "age_s")
    ENDPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    AGE_S_FIELD_NUMBER: _ClassVar[int]
    endpoint_id: str
    hashes: _containers.RepeatedScalarFieldContainer[int]
    age_s: float
    def __init__(self, endpoint_id: _Optional[str] = ..., hashes: _Optional[_Iterable[int]] = ..., age_s: _Optional[float] = ...) -> None: ...
