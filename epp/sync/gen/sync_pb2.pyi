from google.protobuf.internal import containers as _containers
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
    __slots__ = ("endpoint_id", "writes", "roots")
    ENDPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    WRITES_FIELD_NUMBER: _ClassVar[int]
    ROOTS_FIELD_NUMBER: _ClassVar[int]
    endpoint_id: str
    writes: _containers.RepeatedCompositeFieldContainer[Record]
    roots: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, endpoint_id: _Optional[str] = ..., writes: _Optional[_Iterable[_Union[Record, _Mapping]]] = ..., roots: _Optional[_Iterable[int]] = ...) -> None: ...

class SubscribeRequest(_message.Message):
    __slots__ = ("replica_id",)
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    def __init__(self, replica_id: _Optional[str] = ...) -> None: ...

class RecordBatch(_message.Message):
    __slots__ = ("replica_id", "records", "dropped")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    records: _containers.RepeatedCompositeFieldContainer[Record]
    dropped: int
    def __init__(self, replica_id: _Optional[str] = ..., records: _Optional[_Iterable[_Union[Record, _Mapping]]] = ..., dropped: _Optional[int] = ...) -> None: ...

class Record(_message.Message):
    __slots__ = ("endpoint_id", "hashes", "age_s")
    ENDPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    AGE_S_FIELD_NUMBER: _ClassVar[int]
    endpoint_id: str
    hashes: _containers.RepeatedScalarFieldContainer[int]
    age_s: float
    def __init__(self, endpoint_id: _Optional[str] = ..., hashes: _Optional[_Iterable[int]] = ..., age_s: _Optional[float] = ...) -> None: ...
