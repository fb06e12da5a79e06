from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EntryLayout(_message.Message):
    __slots__ = ("num_layers", "num_kv_heads", "head_dim", "dtype", "kind", "num_tokens", "virtual_start", "entry_kind", "packing")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    VIRTUAL_START_FIELD_NUMBER: _ClassVar[int]
    ENTRY_KIND_FIELD_NUMBER: _ClassVar[int]
    PACKING_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    kind: str
    num_tokens: int
    virtual_start: int
    entry_kind: str
    packing: str
    def __init__(self, num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ..., kind: _Optional[str] = ..., num_tokens: _Optional[int] = ..., virtual_start: _Optional[int] = ..., entry_kind: _Optional[str] = ..., packing: _Optional[str] = ...) -> None: ...

class HelloRequest(_message.Message):
    __slots__ = ("client_name", "hostname")
    CLIENT_NAME_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    client_name: str
    hostname: str
    def __init__(self, client_name: _Optional[str] = ..., hostname: _Optional[str] = ...) -> None: ...

class HelloReply(_message.Message):
    __slots__ = ("session_id", "version", "shm_path", "block_size", "num_blocks", "device", "hostname", "lease_ttl_ms", "transfer", "fast_socket", "device_pool")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SHM_PATH_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_FIELD_NUMBER: _ClassVar[int]
    FAST_SOCKET_FIELD_NUMBER: _ClassVar[int]
    DEVICE_POOL_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    version: str
    shm_path: str
    block_size: int
    num_blocks: int
    device: str
    hostname: str
    lease_ttl_ms: int
    transfer: TransferEndpoint
    fast_socket: str
    device_pool: DevicePool
    def __init__(self, session_id: _Optional[str] = ..., version: _Optional[str] = ..., shm_path: _Optional[str] = ..., block_size: _Optional[int] = ..., num_blocks: _Optional[int] = ..., device: _Optional[str] = ..., hostname: _Optional[str] = ..., lease_ttl_ms: _Optional[int] = ..., transfer: _Optional[_Union[TransferEndpoint, _Mapping]] = ..., fast_socket: _Optional[str] = ..., device_pool: _Optional[_Union[DevicePool, _Mapping]] = ...) -> None: ...

class DevicePool(_message.Message):
    __slots__ = ("runtime", "device", "handle", "size", "offset", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required")
    RUNTIME_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    runtime: str
    device: str
    handle: bytes
    size: int
    offset: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    def __init__(self, runtime: _Optional[str] = ..., device: _Optional[str] = ..., handle: _Optional[bytes] = ..., size: _Optional[int] = ..., offset: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ...) -> None: ...

class TransferEndpoint(_message.Message):
    __slots__ = ("engine", "protocol", "session", "base", "size")
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    BASE_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    engine: str
    protocol: str
    session: str
    base: int
    size: int
    def __init__(self, engine: _Optional[str] = ..., protocol: _Optional[str] = ..., session: _Optional[str] = ..., base: _Optional[int] = ..., size: _Optional[int] = ...) -> None: ...

class Ping(_message.Message):
    __slots__ = ("session_id", "holds_pool")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    HOLDS_POOL_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    holds_pool: bool
    def __init__(self, session_id: _Optional[str] = ..., holds_pool: _Optional[bool] = ...) -> None: ...

class Pong(_message.Message):
    __slots__ = ("server_time_ms",)
    SERVER_TIME_MS_FIELD_NUMBER: _ClassVar[int]
    server_time_ms: int
    def __init__(self, server_time_ms: _Optional[int] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("keys", "num_tokens", "entry_kind", "probe")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ENTRY_KIND_FIELD_NUMBER: _ClassVar[int]
    PROBE_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    num_tokens: _containers.RepeatedScalarFieldContainer[int]
    entry_kind: str
    probe: bool
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., num_tokens: _Optional[_Iterable[int]] = ..., entry_kind: _Optional[str] = ..., probe: _Optional[bool] = ...) -> None: ...

class LookupReply(_message.Message):
    __slots__ = ("present", "num_tokens")
    PRESENT_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    present: _containers.RepeatedScalarFieldContainer[bool]
    num_tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, present: _Optional[_Iterable[bool]] = ..., num_tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("session_id", "key", "layout", "nbytes")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    key: bytes
    layout: EntryLayout
    nbytes: int
    def __init__(self, session_id: _Optional[str] = ..., key: _Optional[bytes] = ..., layout: _Optional[_Union[EntryLayout, _Mapping]] = ..., nbytes: _Optional[int] = ...) -> None: ...

class ReserveReply(_message.Message):
    __slots__ = ("reservation_id", "blocks", "block_size")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    reservation_id: int
    blocks: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    def __init__(self, reservation_id: _Optional[int] = ..., blocks: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("session_id", "reservation_id", "checksum", "hold_ms")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    HOLD_MS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    reservation_id: int
    checksum: int
    hold_ms: int
    def __init__(self, session_id: _Optional[str] = ..., reservation_id: _Optional[int] = ..., checksum: _Optional[int] = ..., hold_ms: _Optional[int] = ...) -> None: ...

class CommitReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("session_id", "reservation_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    reservation_id: int
    def __init__(self, session_id: _Optional[str] = ..., reservation_id: _Optional[int] = ...) -> None: ...

class AbortReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AcquireRequest(_message.Message):
    __slots__ = ("session_id", "keys", "num_tokens", "entry_kind", "tenant", "summed")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ENTRY_KIND_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    SUMMED_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    num_tokens: _containers.RepeatedScalarFieldContainer[int]
    entry_kind: str
    tenant: str
    summed: bool
    def __init__(self, session_id: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ..., num_tokens: _Optional[_Iterable[int]] = ..., entry_kind: _Optional[str] = ..., tenant: _Optional[str] = ..., summed: _Optional[bool] = ...) -> None: ...

class Lease(_message.Message):
    __slots__ = ("lease_id", "key", "layout", "nbytes", "blocks", "checksum", "sum_key", "keyed_sums")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    SUM_KEY_FIELD_NUMBER: _ClassVar[int]
    KEYED_SUMS_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    key: bytes
    layout: EntryLayout
    nbytes: int
    blocks: _containers.RepeatedScalarFieldContainer[int]
    checksum: int
    sum_key: _containers.RepeatedScalarFieldContainer[int]
    keyed_sums: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, lease_id: _Optional[int] = ..., key: _Optional[bytes] = ..., layout: _Optional[_Union[EntryLayout, _Mapping]] = ..., nbytes: _Optional[int] = ..., blocks: _Optional[_Iterable[int]] = ..., checksum: _Optional[int] = ..., sum_key: _Optional[_Iterable[int]] = ..., keyed_sums: _Optional[_Iterable[int]] = ...) -> None: ...

class AcquireReply(_message.Message):
    __slots__ = ("leases", "block_size")
    LEASES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    leases: _containers.RepeatedCompositeFieldContainer[Lease]
    block_size: int
    def __init__(self, leases: _Optional[_Iterable[_Union[Lease, _Mapping]]] = ..., block_size: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("session_id", "lease_ids", "shm_bytes_read")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    SHM_BYTES_READ_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    lease_ids: _containers.RepeatedScalarFieldContainer[int]
    shm_bytes_read: int
    def __init__(self, session_id: _Optional[str] = ..., lease_ids: _Optional[_Iterable[int]] = ..., shm_bytes_read: _Optional[int] = ...) -> None: ...

class ReleaseReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WritePiece(_message.Message):
    __slots__ = ("session_id", "reservation_id", "data")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    reservation_id: int
    data: bytes
    def __init__(self, session_id: _Optional[str] = ..., reservation_id: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class WriteReply(_message.Message):
    __slots__ = ("nbytes",)
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    nbytes: int
    def __init__(self, nbytes: _Optional[int] = ...) -> None: ...

class ReadRequest(_message.Message):
    __slots__ = ("session_id", "lease_id", "piece_bytes", "run_starts", "run_bytes")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    PIECE_BYTES_FIELD_NUMBER: _ClassVar[int]
    RUN_STARTS_FIELD_NUMBER: _ClassVar[int]
    RUN_BYTES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    lease_id: int
    piece_bytes: int
    run_starts: _containers.RepeatedScalarFieldContainer[int]
    run_bytes: int
    def __init__(self, session_id: _Optional[str] = ..., lease_id: _Optional[int] = ..., piece_bytes: _Optional[int] = ..., run_starts: _Optional[_Iterable[int]] = ..., run_bytes: _Optional[int] = ...) -> None: ...

class ReadPiece(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsReply(_message.Message):
    __slots__ = ("entries", "pinned_entries", "bytes_used", "bytes_capacity", "blocks_free", "blocks_total", "active_leases", "active_reservations", "sessions", "lookups", "hits", "lookup_tokens", "hit_tokens", "evictions", "draining", "blocks_quarantined", "pool_importers", "kinds", "disk", "tenants")
    class EvictionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class KindsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: KindStats
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[KindStats, _Mapping]] = ...) -> None: ...
    class TenantsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: TenantStats
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[TenantStats, _Mapping]] = ...) -> None: ...
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    PINNED_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    BYTES_USED_FIELD_NUMBER: _ClassVar[int]
    BYTES_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_LEASES_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_RESERVATIONS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_QUARANTINED_FIELD_NUMBER: _ClassVar[int]
    POOL_IMPORTERS_FIELD_NUMBER: _ClassVar[int]
    KINDS_FIELD_NUMBER: _ClassVar[int]
    DISK_FIELD_NUMBER: _ClassVar[int]
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    entries: int
    pinned_entries: int
    bytes_used: int
    bytes_capacity: int
    blocks_free: int
    blocks_total: int
    active_leases: int
    active_reservations: int
    sessions: int
    lookups: int
    hits: int
    lookup_tokens: int
    hit_tokens: int
    evictions: _containers.ScalarMap[str, int]
    draining: bool
    blocks_quarantined: int
    pool_importers: int
    kinds: _containers.MessageMap[str, KindStats]
    disk: DiskStats
    tenants: _containers.MessageMap[str, TenantStats]
    def __init__(self, entries: _Optional[int] = ..., pinned_entries: _Optional[int] = ..., bytes_used: _Optional[int] = ..., bytes_capacity: _Optional[int] = ..., blocks_free: _Optional[int] = ..., blocks_total: _Optional[int] = ..., active_leases: _Optional[int] = ..., active_reservations: _Optional[int] = ..., sessions: _Optional[int] = ..., lookups: _Optional[int] = ..., hits: _Optional[int] = ..., lookup_tokens: _Optional[int] = ..., hit_tokens: _Optional[int] = ..., evictions: _Optional[_Mapping[str, int]] = ..., draining: _Optional[bool] = ..., blocks_quarantined: _Optional[int] = ..., pool_importers: _Optional[int] = ..., kinds: _Optional[_Mapping[str, KindStats]] = ..., disk: _Optional[_Union[DiskStats, _Mapping]] = ..., tenants: _Optional[_Mapping[str, TenantStats]] = ...) -> None: ...

class TenantStats(_message.Message):
    __slots__ = ("entries", "bytes", "held_bytes", "quota_bytes", "reserved_bytes", "lookups", "hits", "lookup_tokens", "hit_tokens", "evictions")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    HELD_BYTES_FIELD_NUMBER: _ClassVar[int]
    QUOTA_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESERVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    entries: int
    bytes: int
    held_bytes: int
    quota_bytes: int
    reserved_bytes: int
    lookups: int
    hits: int
    lookup_tokens: int
    hit_tokens: int
    evictions: int
    def __init__(self, entries: _Optional[int] = ..., bytes: _Optional[int] = ..., held_bytes: _Optional[int] = ..., quota_bytes: _Optional[int] = ..., reserved_bytes: _Optional[int] = ..., lookups: _Optional[int] = ..., hits: _Optional[int] = ..., lookup_tokens: _Optional[int] = ..., hit_tokens: _Optional[int] = ..., evictions: _Optional[int] = ...) -> None: ...

class DiskStats(_message.Message):
    __slots__ = ("directory", "entries", "bytes_used", "bytes_capacity", "spill_queue_bytes", "spills_writing", "removed_at_start", "last_error", "counts", "seconds")
    class CountsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class SecondsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    BYTES_USED_FIELD_NUMBER: _ClassVar[int]
    BYTES_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    SPILL_QUEUE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SPILLS_WRITING_FIELD_NUMBER: _ClassVar[int]
    REMOVED_AT_START_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    directory: str
    entries: int
    bytes_used: int
    bytes_capacity: int
    spill_queue_bytes: int
    spills_writing: int
    removed_at_start: int
    last_error: str
    counts: _containers.ScalarMap[str, int]
    seconds: _containers.ScalarMap[str, float]
    def __init__(self, directory: _Optional[str] = ..., entries: _Optional[int] = ..., bytes_used: _Optional[int] = ..., bytes_capacity: _Optional[int] = ..., spill_queue_bytes: _Optional[int] = ..., spills_writing: _Optional[int] = ..., removed_at_start: _Optional[int] = ..., last_error: _Optional[str] = ..., counts: _Optional[_Mapping[str, int]] = ..., seconds: _Optional[_Mapping[str, float]] = ...) -> None: ...

class KindStats(_message.Message):
    __slots__ = ("lookups", "hits", "lookup_tokens", "hit_tokens", "entries", "bytes")
    LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    lookups: int
    hits: int
    lookup_tokens: int
    hit_tokens: int
    entries: int
    bytes: int
    def __init__(self, lookups: _Optional[int] = ..., hits: _Optional[int] = ..., lookup_tokens: _Optional[int] = ..., hit_tokens: _Optional[int] = ..., entries: _Optional[int] = ..., bytes: _Optional[int] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("keys", "session_id", "lease_ids")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    session_id: str
    lease_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., session_id: _Optional[str] = ..., lease_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class VerifyReply(_message.Message):
    __slots__ = ("corrupt", "lapsed")
    CORRUPT_FIELD_NUMBER: _ClassVar[int]
    LAPSED_FIELD_NUMBER: _ClassVar[int]
    corrupt: _containers.RepeatedScalarFieldContainer[bytes]
    lapsed: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, corrupt: _Optional[_Iterable[bytes]] = ..., lapsed: _Optional[_Iterable[int]] = ...) -> None: ...

class EvictRequest(_message.Message):
    __slots__ = ("keys", "tenant")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    tenant: str
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., tenant: _Optional[str] = ...) -> None: ...

class EvictReply(_message.Message):
    __slots__ = ("evicted", "busy")
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    BUSY_FIELD_NUMBER: _ClassVar[int]
    evicted: int
    busy: int
    def __init__(self, evicted: _Optional[int] = ..., busy: _Optional[int] = ...) -> None: ...

class ClearRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ClearReply(_message.Message):
    __slots__ = ("evicted", "busy")
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    BUSY_FIELD_NUMBER: _ClassVar[int]
    evicted: int
    busy: int
    def __init__(self, evicted: _Optional[int] = ..., busy: _Optional[int] = ...) -> None: ...

class PinRequest(_message.Message):
    __slots__ = ("keys", "tenant")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    tenant: str
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., tenant: _Optional[str] = ...) -> None: ...

class PinReply(_message.Message):
    __slots__ = ("changed",)
    CHANGED_FIELD_NUMBER: _ClassVar[int]
    changed: int
    def __init__(self, changed: _Optional[int] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("timeout_ms",)
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    timeout_ms: int
    def __init__(self, timeout_ms: _Optional[int] = ...) -> None: ...

class DrainReply(_message.Message):
    __slots__ = ("leases_left",)
    LEASES_LEFT_FIELD_NUMBER: _ClassVar[int]
    leases_left: int
    def __init__(self, leases_left: _Optional[int] = ...) -> None: ...

class UndrainRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class UndrainReply(_message.Message):
    __slots__ = ("was_draining",)
    WAS_DRAINING_FIELD_NUMBER: _ClassVar[int]
    was_draining: bool
    def __init__(self, was_draining: _Optional[bool] = ...) -> None: ...
