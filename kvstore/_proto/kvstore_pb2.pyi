from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_UNSPECIFIED: _ClassVar[Tier]
    TIER_HOST: _ClassVar[Tier]
    TIER_SSD: _ClassVar[Tier]
    TIER_REDIS: _ClassVar[Tier]

class PutOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PUT_OUTCOME_UNSPECIFIED: _ClassVar[PutOutcome]
    PUT_OUTCOME_STORED: _ClassVar[PutOutcome]
    PUT_OUTCOME_EXISTS: _ClassVar[PutOutcome]
    PUT_OUTCOME_NO_ROOM: _ClassVar[PutOutcome]
    PUT_OUTCOME_FAILED: _ClassVar[PutOutcome]
TIER_UNSPECIFIED: Tier
TIER_HOST: Tier
TIER_SSD: Tier
TIER_REDIS: Tier
PUT_OUTCOME_UNSPECIFIED: PutOutcome
PUT_OUTCOME_STORED: PutOutcome
PUT_OUTCOME_EXISTS: PutOutcome
PUT_OUTCOME_NO_ROOM: PutOutcome
PUT_OUTCOME_FAILED: PutOutcome

class HelloRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HelloResponse(_message.Message):
    __slots__ = ("tenant", "permissions", "segment_path", "segment_size", "segment_inode", "boot_id", "max_object_bytes", "max_keys_per_call", "lease_ms", "frame_bytes", "server_version", "data_port", "shm_socket", "kv_events", "max_calls")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    PERMISSIONS_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_PATH_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_SIZE_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_INODE_FIELD_NUMBER: _ClassVar[int]
    BOOT_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_OBJECT_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_KEYS_PER_CALL_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    FRAME_BYTES_FIELD_NUMBER: _ClassVar[int]
    SERVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    SHM_SOCKET_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_FIELD_NUMBER: _ClassVar[int]
    MAX_CALLS_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    permissions: _containers.RepeatedScalarFieldContainer[str]
    segment_path: str
    segment_size: int
    segment_inode: int
    boot_id: str
    max_object_bytes: int
    max_keys_per_call: int
    lease_ms: int
    frame_bytes: int
    server_version: str
    data_port: int
    shm_socket: str
    kv_events: bool
    max_calls: int
    def __init__(self, tenant: _Optional[str] = ..., permissions: _Optional[_Iterable[str]] = ..., segment_path: _Optional[str] = ..., segment_size: _Optional[int] = ..., segment_inode: _Optional[int] = ..., boot_id: _Optional[str] = ..., max_object_bytes: _Optional[int] = ..., max_keys_per_call: _Optional[int] = ..., lease_ms: _Optional[int] = ..., frame_bytes: _Optional[int] = ..., server_version: _Optional[str] = ..., data_port: _Optional[int] = ..., shm_socket: _Optional[str] = ..., kv_events: _Optional[bool] = ..., max_calls: _Optional[int] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("namespace", "chunk_hashes", "tag")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_HASHES_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    chunk_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    tag: str
    def __init__(self, namespace: _Optional[bytes] = ..., chunk_hashes: _Optional[_Iterable[bytes]] = ..., tag: _Optional[str] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("hits", "tiers", "sizes")
    HITS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    hits: int
    tiers: _containers.RepeatedScalarFieldContainer[Tier]
    sizes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, hits: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[Tier, str]]] = ..., sizes: _Optional[_Iterable[int]] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("namespace", "chunk_hash", "tag", "lease_ms")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_HASH_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    chunk_hash: bytes
    tag: str
    lease_ms: int
    def __init__(self, namespace: _Optional[bytes] = ..., chunk_hash: _Optional[bytes] = ..., tag: _Optional[str] = ..., lease_ms: _Optional[int] = ...) -> None: ...

class GetResponse(_message.Message):
    __slots__ = ("found", "offset", "length", "lease_id", "lease_ms", "tier")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    found: bool
    offset: int
    length: int
    lease_id: int
    lease_ms: int
    tier: Tier
    def __init__(self, found: _Optional[bool] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., lease_id: _Optional[int] = ..., lease_ms: _Optional[int] = ..., tier: _Optional[_Union[Tier, str]] = ...) -> None: ...

class GetFrame(_message.Message):
    __slots__ = ("found", "total_length", "offset", "data", "tier")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    TOTAL_LENGTH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    found: bool
    total_length: int
    offset: int
    data: bytes
    tier: Tier
    def __init__(self, found: _Optional[bool] = ..., total_length: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., tier: _Optional[_Union[Tier, str]] = ...) -> None: ...

class PutStartRequest(_message.Message):
    __slots__ = ("namespace", "chunk_hash", "tag", "size", "parent_hash", "session")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_HASH_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    chunk_hash: bytes
    tag: str
    size: int
    parent_hash: bytes
    session: int
    def __init__(self, namespace: _Optional[bytes] = ..., chunk_hash: _Optional[bytes] = ..., tag: _Optional[str] = ..., size: _Optional[int] = ..., parent_hash: _Optional[bytes] = ..., session: _Optional[int] = ...) -> None: ...

class PutStartResponse(_message.Message):
    __slots__ = ("outcome", "put_id", "offset", "length", "ttl_ms")
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    PUT_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    outcome: PutOutcome
    put_id: int
    offset: int
    length: int
    ttl_ms: int
    def __init__(self, outcome: _Optional[_Union[PutOutcome, str]] = ..., put_id: _Optional[int] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., ttl_ms: _Optional[int] = ...) -> None: ...

class PutCommitRequest(_message.Message):
    __slots__ = ("put_id", "abort")
    PUT_ID_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    put_id: int
    abort: bool
    def __init__(self, put_id: _Optional[int] = ..., abort: _Optional[bool] = ...) -> None: ...

class PutCommitResponse(_message.Message):
    __slots__ = ("outcome",)
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    outcome: PutOutcome
    def __init__(self, outcome: _Optional[_Union[PutOutcome, str]] = ...) -> None: ...

class PutFrame(_message.Message):
    __slots__ = ("start", "data")
    START_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    start: PutStartRequest
    data: bytes
    def __init__(self, start: _Optional[_Union[PutStartRequest, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("namespace", "chunk_hash", "tag")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_HASH_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    chunk_hash: bytes
    tag: str
    def __init__(self, namespace: _Optional[bytes] = ..., chunk_hash: _Optional[bytes] = ..., tag: _Optional[str] = ...) -> None: ...

class DeleteResponse(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: bool
    def __init__(self, deleted: _Optional[bool] = ...) -> None: ...

class RenewLeaseRequest(_message.Message):
    __slots__ = ("lease_id", "lease_ms")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    lease_ms: int
    def __init__(self, lease_id: _Optional[int] = ..., lease_ms: _Optional[int] = ...) -> None: ...

class RenewLeaseResponse(_message.Message):
    __slots__ = ("lease_ms",)
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    lease_ms: int
    def __init__(self, lease_ms: _Optional[int] = ...) -> None: ...

class ReleaseLeaseRequest(_message.Message):
    __slots__ = ("lease_ids",)
    LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    lease_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, lease_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ReleaseLeaseResponse(_message.Message):
    __slots__ = ("valid",)
    VALID_FIELD_NUMBER: _ClassVar[int]
    valid: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, valid: _Optional[_Iterable[bool]] = ...) -> None: ...

class OpenDataRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class OpenDataResponse(_message.Message):
    __slots__ = ("ticket", "ttl_ms", "data_port")
    TICKET_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    ticket: bytes
    ttl_ms: int
    data_port: int
    def __init__(self, ticket: _Optional[bytes] = ..., ttl_ms: _Optional[int] = ..., data_port: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("json", "counters")
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    JSON_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    json: str
    counters: _containers.ScalarMap[str, float]
    def __init__(self, json: _Optional[str] = ..., counters: _Optional[_Mapping[str, float]] = ...) -> None: ...

class ObjectDescription(_message.Message):
    __slots__ = ("chunk_hash", "parent_hash", "token_ids", "lora_name")
    CHUNK_HASH_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    chunk_hash: bytes
    parent_hash: bytes
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    lora_name: str
    def __init__(self, chunk_hash: _Optional[bytes] = ..., parent_hash: _Optional[bytes] = ..., token_ids: _Optional[_Iterable[int]] = ..., lora_name: _Optional[str] = ...) -> None: ...

class DescribeRequest(_message.Message):
    __slots__ = ("namespace", "tag", "objects")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    tag: str
    objects: _containers.RepeatedCompositeFieldContainer[ObjectDescription]
    def __init__(self, namespace: _Optional[bytes] = ..., tag: _Optional[str] = ..., objects: _Optional[_Iterable[_Union[ObjectDescription, _Mapping]]] = ...) -> None: ...

class DescribeResponse(_message.Message):
    __slots__ = ("described",)
    DESCRIBED_FIELD_NUMBER: _ClassVar[int]
    described: int
    def __init__(self, described: _Optional[int] = ...) -> None: ...
