from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Status(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OK: _ClassVar[Status]
    JOURNAL_NOT_FOUND: _ClassVar[Status]
    NO_JOURNAL_PRIMARY_BROKER: _ClassVar[Status]
    NOT_JOURNAL_PRIMARY_BROKER: _ClassVar[Status]
    NOT_JOURNAL_BROKER: _ClassVar[Status]
    INSUFFICIENT_JOURNAL_BROKERS: _ClassVar[Status]
    OFFSET_NOT_YET_AVAILABLE: _ClassVar[Status]
    WRONG_ROUTE: _ClassVar[Status]
    PROPOSAL_MISMATCH: _ClassVar[Status]
    ETCD_TRANSACTION_FAILED: _ClassVar[Status]
    NOT_ALLOWED: _ClassVar[Status]
    WRONG_APPEND_OFFSET: _ClassVar[Status]
    INDEX_HAS_GREATER_OFFSET: _ClassVar[Status]
    REGISTER_MISMATCH: _ClassVar[Status]
    FRAGMENT_STORE_UNHEALTHY: _ClassVar[Status]
    SUSPENDED: _ClassVar[Status]
    SHARD_NOT_FOUND: _ClassVar[Status]
    NO_SHARD_PRIMARY: _ClassVar[Status]
    NOT_SHARD_PRIMARY: _ClassVar[Status]
    SHARD_STOPPED: _ClassVar[Status]
    TARGET_NOT_FOUND: _ClassVar[Status]
    TARGET_FENCED: _ClassVar[Status]
    WRONG_TARGET_INDEX: _ClassVar[Status]
    NO_RECOVERY_LOG: _ClassVar[Status]

class CompressionCodec(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    INVALID: _ClassVar[CompressionCodec]
    NONE: _ClassVar[CompressionCodec]
    GZIP: _ClassVar[CompressionCodec]
    ZSTANDARD: _ClassVar[CompressionCodec]
OK: Status
JOURNAL_NOT_FOUND: Status
NO_JOURNAL_PRIMARY_BROKER: Status
NOT_JOURNAL_PRIMARY_BROKER: Status
NOT_JOURNAL_BROKER: Status
INSUFFICIENT_JOURNAL_BROKERS: Status
OFFSET_NOT_YET_AVAILABLE: Status
WRONG_ROUTE: Status
PROPOSAL_MISMATCH: Status
ETCD_TRANSACTION_FAILED: Status
NOT_ALLOWED: Status
WRONG_APPEND_OFFSET: Status
INDEX_HAS_GREATER_OFFSET: Status
REGISTER_MISMATCH: Status
FRAGMENT_STORE_UNHEALTHY: Status
SUSPENDED: Status
SHARD_NOT_FOUND: Status
NO_SHARD_PRIMARY: Status
NOT_SHARD_PRIMARY: Status
SHARD_STOPPED: Status
TARGET_NOT_FOUND: Status
TARGET_FENCED: Status
WRONG_TARGET_INDEX: Status
NO_RECOVERY_LOG: Status
INVALID: CompressionCodec
NONE: CompressionCodec
GZIP: CompressionCodec
ZSTANDARD: CompressionCodec

class Label(_message.Message):
    __slots__ = ("name", "value")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    name: str
    value: str
    def __init__(self, name: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...

class LabelSet(_message.Message):
    __slots__ = ("labels",)
    LABELS_FIELD_NUMBER: _ClassVar[int]
    labels: _containers.RepeatedCompositeFieldContainer[Label]
    def __init__(self, labels: _Optional[_Iterable[_Union[Label, _Mapping]]] = ...) -> None: ...

class LabelSelector(_message.Message):
    __slots__ = ("include", "exclude")
    INCLUDE_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_FIELD_NUMBER: _ClassVar[int]
    include: LabelSet
    exclude: LabelSet
    def __init__(self, include: _Optional[_Union[LabelSet, _Mapping]] = ..., exclude: _Optional[_Union[LabelSet, _Mapping]] = ...) -> None: ...

class ProcessId(_message.Message):
    __slots__ = ("zone", "suffix")
    ZONE_FIELD_NUMBER: _ClassVar[int]
    SUFFIX_FIELD_NUMBER: _ClassVar[int]
    zone: str
    suffix: str
    def __init__(self, zone: _Optional[str] = ..., suffix: _Optional[str] = ...) -> None: ...

class BrokerSpec(_message.Message):
    __slots__ = ("id", "endpoint", "journal_limit", "exiting", "replication_endpoint", "metrics_endpoint")
    ID_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    JOURNAL_LIMIT_FIELD_NUMBER: _ClassVar[int]
    EXITING_FIELD_NUMBER: _ClassVar[int]
    REPLICATION_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    METRICS_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    id: ProcessId
    endpoint: str
    journal_limit: int
    exiting: bool
    replication_endpoint: str
    metrics_endpoint: str
    def __init__(self, id: _Optional[_Union[ProcessId, _Mapping]] = ..., endpoint: _Optional[str] = ..., journal_limit: _Optional[int] = ..., exiting: _Optional[bool] = ..., replication_endpoint: _Optional[str] = ..., metrics_endpoint: _Optional[str] = ...) -> None: ...

class ConsumerSpec(_message.Message):
    __slots__ = ("id", "endpoint", "shard_limit", "exiting")
    ID_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    SHARD_LIMIT_FIELD_NUMBER: _ClassVar[int]
    EXITING_FIELD_NUMBER: _ClassVar[int]
    id: ProcessId
    endpoint: str
    shard_limit: int
    exiting: bool
    def __init__(self, id: _Optional[_Union[ProcessId, _Mapping]] = ..., endpoint: _Optional[str] = ..., shard_limit: _Optional[int] = ..., exiting: _Optional[bool] = ...) -> None: ...

class ShardSpec(_message.Message):
    __slots__ = ("id", "sources", "recovery_log_prefix", "hint_prefix", "hint_backups", "max_txn_duration_ms", "min_txn_duration_ms", "disable", "hot_standbys", "labels", "disable_wait_for_ack", "ring_buffer_size", "read_channel_size")
    class Source(_message.Message):
        __slots__ = ("journal", "min_offset")
        JOURNAL_FIELD_NUMBER: _ClassVar[int]
        MIN_OFFSET_FIELD_NUMBER: _ClassVar[int]
        journal: str
        min_offset: int
        def __init__(self, journal: _Optional[str] = ..., min_offset: _Optional[int] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    RECOVERY_LOG_PREFIX_FIELD_NUMBER: _ClassVar[int]
    HINT_PREFIX_FIELD_NUMBER: _ClassVar[int]
    HINT_BACKUPS_FIELD_NUMBER: _ClassVar[int]
    MAX_TXN_DURATION_MS_FIELD_NUMBER: _ClassVar[int]
    MIN_TXN_DURATION_MS_FIELD_NUMBER: _ClassVar[int]
    DISABLE_FIELD_NUMBER: _ClassVar[int]
    HOT_STANDBYS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    DISABLE_WAIT_FOR_ACK_FIELD_NUMBER: _ClassVar[int]
    RING_BUFFER_SIZE_FIELD_NUMBER: _ClassVar[int]
    READ_CHANNEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    id: str
    sources: _containers.RepeatedCompositeFieldContainer[ShardSpec.Source]
    recovery_log_prefix: str
    hint_prefix: str
    hint_backups: int
    max_txn_duration_ms: int
    min_txn_duration_ms: int
    disable: bool
    hot_standbys: int
    labels: LabelSet
    disable_wait_for_ack: bool
    ring_buffer_size: int
    read_channel_size: int
    def __init__(self, id: _Optional[str] = ..., sources: _Optional[_Iterable[_Union[ShardSpec.Source, _Mapping]]] = ..., recovery_log_prefix: _Optional[str] = ..., hint_prefix: _Optional[str] = ..., hint_backups: _Optional[int] = ..., max_txn_duration_ms: _Optional[int] = ..., min_txn_duration_ms: _Optional[int] = ..., disable: _Optional[bool] = ..., hot_standbys: _Optional[int] = ..., labels: _Optional[_Union[LabelSet, _Mapping]] = ..., disable_wait_for_ack: _Optional[bool] = ..., ring_buffer_size: _Optional[int] = ..., read_channel_size: _Optional[int] = ...) -> None: ...

class ReplicaStatus(_message.Message):
    __slots__ = ("code", "errors")
    class Code(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        IDLE: _ClassVar[ReplicaStatus.Code]
        BACKFILL: _ClassVar[ReplicaStatus.Code]
        STANDBY: _ClassVar[ReplicaStatus.Code]
        PRIMARY: _ClassVar[ReplicaStatus.Code]
        FAILED: _ClassVar[ReplicaStatus.Code]
    IDLE: ReplicaStatus.Code
    BACKFILL: ReplicaStatus.Code
    STANDBY: ReplicaStatus.Code
    PRIMARY: ReplicaStatus.Code
    FAILED: ReplicaStatus.Code
    CODE_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    code: ReplicaStatus.Code
    errors: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, code: _Optional[_Union[ReplicaStatus.Code, str]] = ..., errors: _Optional[_Iterable[str]] = ...) -> None: ...

class Checkpoint(_message.Message):
    __slots__ = ("sources", "ack_intents")
    class ProducerState(_message.Message):
        __slots__ = ("last_ack", "begin", "newest")
        LAST_ACK_FIELD_NUMBER: _ClassVar[int]
        BEGIN_FIELD_NUMBER: _ClassVar[int]
        NEWEST_FIELD_NUMBER: _ClassVar[int]
        last_ack: int
        begin: int
        newest: int
        def __init__(self, last_ack: _Optional[int] = ..., begin: _Optional[int] = ..., newest: _Optional[int] = ...) -> None: ...
    class Source(_message.Message):
        __slots__ = ("read_through", "producers")
        class ProducerEntry(_message.Message):
            __slots__ = ("id", "state")
            ID_FIELD_NUMBER: _ClassVar[int]
            STATE_FIELD_NUMBER: _ClassVar[int]
            id: bytes
            state: Checkpoint.ProducerState
            def __init__(self, id: _Optional[bytes] = ..., state: _Optional[_Union[Checkpoint.ProducerState, _Mapping]] = ...) -> None: ...
        READ_THROUGH_FIELD_NUMBER: _ClassVar[int]
        PRODUCERS_FIELD_NUMBER: _ClassVar[int]
        read_through: int
        producers: _containers.RepeatedCompositeFieldContainer[Checkpoint.Source.ProducerEntry]
        def __init__(self, read_through: _Optional[int] = ..., producers: _Optional[_Iterable[_Union[Checkpoint.Source.ProducerEntry, _Mapping]]] = ...) -> None: ...
    class SourcesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: Checkpoint.Source
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[Checkpoint.Source, _Mapping]] = ...) -> None: ...
    class AckIntentsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bytes
        def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    ACK_INTENTS_FIELD_NUMBER: _ClassVar[int]
    sources: _containers.MessageMap[str, Checkpoint.Source]
    ack_intents: _containers.ScalarMap[str, bytes]
    def __init__(self, sources: _Optional[_Mapping[str, Checkpoint.Source]] = ..., ack_intents: _Optional[_Mapping[str, bytes]] = ...) -> None: ...

class JournalSpec(_message.Message):
    __slots__ = ("name", "replication", "labels", "fragment", "flags", "max_append_rate", "suspend")
    class Flag(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        NOT_SPECIFIED: _ClassVar[JournalSpec.Flag]
        O_RDONLY: _ClassVar[JournalSpec.Flag]
        O_WRONLY: _ClassVar[JournalSpec.Flag]
        O_RDWR: _ClassVar[JournalSpec.Flag]
    NOT_SPECIFIED: JournalSpec.Flag
    O_RDONLY: JournalSpec.Flag
    O_WRONLY: JournalSpec.Flag
    O_RDWR: JournalSpec.Flag
    class FragmentSpec(_message.Message):
        __slots__ = ("length", "compression_codec", "stores", "refresh_interval_ms", "retention_ms", "flush_interval_ms")
        LENGTH_FIELD_NUMBER: _ClassVar[int]
        COMPRESSION_CODEC_FIELD_NUMBER: _ClassVar[int]
        STORES_FIELD_NUMBER: _ClassVar[int]
        REFRESH_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
        RETENTION_MS_FIELD_NUMBER: _ClassVar[int]
        FLUSH_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
        length: int
        compression_codec: CompressionCodec
        stores: _containers.RepeatedScalarFieldContainer[str]
        refresh_interval_ms: int
        retention_ms: int
        flush_interval_ms: int
        def __init__(self, length: _Optional[int] = ..., compression_codec: _Optional[_Union[CompressionCodec, str]] = ..., stores: _Optional[_Iterable[str]] = ..., refresh_interval_ms: _Optional[int] = ..., retention_ms: _Optional[int] = ..., flush_interval_ms: _Optional[int] = ...) -> None: ...
    class Suspend(_message.Message):
        __slots__ = ("level", "offset")
        class Level(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
            __slots__ = ()
            NONE: _ClassVar[JournalSpec.Suspend.Level]
            PARTIAL: _ClassVar[JournalSpec.Suspend.Level]
            FULL: _ClassVar[JournalSpec.Suspend.Level]
        NONE: JournalSpec.Suspend.Level
        PARTIAL: JournalSpec.Suspend.Level
        FULL: JournalSpec.Suspend.Level
        LEVEL_FIELD_NUMBER: _ClassVar[int]
        OFFSET_FIELD_NUMBER: _ClassVar[int]
        level: JournalSpec.Suspend.Level
        offset: int
        def __init__(self, level: _Optional[_Union[JournalSpec.Suspend.Level, str]] = ..., offset: _Optional[int] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    REPLICATION_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    FLAGS_FIELD_NUMBER: _ClassVar[int]
    MAX_APPEND_RATE_FIELD_NUMBER: _ClassVar[int]
    SUSPEND_FIELD_NUMBER: _ClassVar[int]
    name: str
    replication: int
    labels: LabelSet
    fragment: JournalSpec.FragmentSpec
    flags: int
    max_append_rate: int
    suspend: JournalSpec.Suspend
    def __init__(self, name: _Optional[str] = ..., replication: _Optional[int] = ..., labels: _Optional[_Union[LabelSet, _Mapping]] = ..., fragment: _Optional[_Union[JournalSpec.FragmentSpec, _Mapping]] = ..., flags: _Optional[int] = ..., max_append_rate: _Optional[int] = ..., suspend: _Optional[_Union[JournalSpec.Suspend, _Mapping]] = ...) -> None: ...

class Route(_message.Message):
    __slots__ = ("members", "primary", "endpoints", "data_endpoints")
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    PRIMARY_FIELD_NUMBER: _ClassVar[int]
    ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    DATA_ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    members: _containers.RepeatedCompositeFieldContainer[ProcessId]
    primary: int
    endpoints: _containers.RepeatedScalarFieldContainer[str]
    data_endpoints: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, members: _Optional[_Iterable[_Union[ProcessId, _Mapping]]] = ..., primary: _Optional[int] = ..., endpoints: _Optional[_Iterable[str]] = ..., data_endpoints: _Optional[_Iterable[str]] = ...) -> None: ...

class Header(_message.Message):
    __slots__ = ("process_id", "route", "etcd")
    class Etcd(_message.Message):
        __slots__ = ("cluster_id", "member_id", "revision", "raft_term")
        CLUSTER_ID_FIELD_NUMBER: _ClassVar[int]
        MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
        REVISION_FIELD_NUMBER: _ClassVar[int]
        RAFT_TERM_FIELD_NUMBER: _ClassVar[int]
        cluster_id: int
        member_id: int
        revision: int
        raft_term: int
        def __init__(self, cluster_id: _Optional[int] = ..., member_id: _Optional[int] = ..., revision: _Optional[int] = ..., raft_term: _Optional[int] = ...) -> None: ...
    PROCESS_ID_FIELD_NUMBER: _ClassVar[int]
    ROUTE_FIELD_NUMBER: _ClassVar[int]
    ETCD_FIELD_NUMBER: _ClassVar[int]
    process_id: ProcessId
    route: Route
    etcd: Header.Etcd
    def __init__(self, process_id: _Optional[_Union[ProcessId, _Mapping]] = ..., route: _Optional[_Union[Route, _Mapping]] = ..., etcd: _Optional[_Union[Header.Etcd, _Mapping]] = ...) -> None: ...

class Fragment(_message.Message):
    __slots__ = ("journal", "begin", "end", "sum", "compression_codec", "backing_store", "mod_time")
    JOURNAL_FIELD_NUMBER: _ClassVar[int]
    BEGIN_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    SUM_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_CODEC_FIELD_NUMBER: _ClassVar[int]
    BACKING_STORE_FIELD_NUMBER: _ClassVar[int]
    MOD_TIME_FIELD_NUMBER: _ClassVar[int]
    journal: str
    begin: int
    end: int
    sum: bytes
    compression_codec: CompressionCodec
    backing_store: str
    mod_time: int
    def __init__(self, journal: _Optional[str] = ..., begin: _Optional[int] = ..., end: _Optional[int] = ..., sum: _Optional[bytes] = ..., compression_codec: _Optional[_Union[CompressionCodec, str]] = ..., backing_store: _Optional[str] = ..., mod_time: _Optional[int] = ...) -> None: ...

class ReadRequest(_message.Message):
    __slots__ = ("header", "journal", "offset", "block", "do_not_proxy", "metadata_only", "end_offset")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    JOURNAL_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    DO_NOT_PROXY_FIELD_NUMBER: _ClassVar[int]
    METADATA_ONLY_FIELD_NUMBER: _ClassVar[int]
    END_OFFSET_FIELD_NUMBER: _ClassVar[int]
    header: Header
    journal: str
    offset: int
    block: bool
    do_not_proxy: bool
    metadata_only: bool
    end_offset: int
    def __init__(self, header: _Optional[_Union[Header, _Mapping]] = ..., journal: _Optional[str] = ..., offset: _Optional[int] = ..., block: _Optional[bool] = ..., do_not_proxy: _Optional[bool] = ..., metadata_only: _Optional[bool] = ..., end_offset: _Optional[int] = ...) -> None: ...

class ReadResponse(_message.Message):
    __slots__ = ("status", "header", "offset", "write_head", "fragment", "fragment_url", "content", "spool_end")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    WRITE_HEAD_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_URL_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    SPOOL_END_FIELD_NUMBER: _ClassVar[int]
    status: Status
    header: Header
    offset: int
    write_head: int
    fragment: Fragment
    fragment_url: str
    content: bytes
    spool_end: int
    def __init__(self, status: _Optional[_Union[Status, str]] = ..., header: _Optional[_Union[Header, _Mapping]] = ..., offset: _Optional[int] = ..., write_head: _Optional[int] = ..., fragment: _Optional[_Union[Fragment, _Mapping]] = ..., fragment_url: _Optional[str] = ..., content: _Optional[bytes] = ..., spool_end: _Optional[int] = ...) -> None: ...

class AppendRequest(_message.Message):
    __slots__ = ("header", "journal", "do_not_proxy", "content", "offset", "check_registers", "union_registers", "subtract_registers", "commit", "suspend")
    class Suspend(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        SUSPEND_RESUME: _ClassVar[AppendRequest.Suspend]
        SUSPEND_NO_RESUME: _ClassVar[AppendRequest.Suspend]
        SUSPEND_IF_FLUSHED: _ClassVar[AppendRequest.Suspend]
        SUSPEND_NOW: _ClassVar[AppendRequest.Suspend]
        SUSPEND_KEEP: _ClassVar[AppendRequest.Suspend]
    SUSPEND_RESUME: AppendRequest.Suspend
    SUSPEND_NO_RESUME: AppendRequest.Suspend
    SUSPEND_IF_FLUSHED: AppendRequest.Suspend
    SUSPEND_NOW: AppendRequest.Suspend
    SUSPEND_KEEP: AppendRequest.Suspend
    HEADER_FIELD_NUMBER: _ClassVar[int]
    JOURNAL_FIELD_NUMBER: _ClassVar[int]
    DO_NOT_PROXY_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    CHECK_REGISTERS_FIELD_NUMBER: _ClassVar[int]
    UNION_REGISTERS_FIELD_NUMBER: _ClassVar[int]
    SUBTRACT_REGISTERS_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    SUSPEND_FIELD_NUMBER: _ClassVar[int]
    header: Header
    journal: str
    do_not_proxy: bool
    content: bytes
    offset: int
    check_registers: LabelSelector
    union_registers: LabelSet
    subtract_registers: LabelSet
    commit: bool
    suspend: AppendRequest.Suspend
    def __init__(self, header: _Optional[_Union[Header, _Mapping]] = ..., journal: _Optional[str] = ..., do_not_proxy: _Optional[bool] = ..., content: _Optional[bytes] = ..., offset: _Optional[int] = ..., check_registers: _Optional[_Union[LabelSelector, _Mapping]] = ..., union_registers: _Optional[_Union[LabelSet, _Mapping]] = ..., subtract_registers: _Optional[_Union[LabelSet, _Mapping]] = ..., commit: _Optional[bool] = ..., suspend: _Optional[_Union[AppendRequest.Suspend, str]] = ...) -> None: ...

class AppendResponse(_message.Message):
    __slots__ = ("status", "header", "commit", "registers", "total_chunks", "delayed_chunks")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    REGISTERS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    DELAYED_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    status: Status
    header: Header
    commit: Fragment
    registers: LabelSet
    total_chunks: int
    delayed_chunks: int
    def __init__(self, status: _Optional[_Union[Status, str]] = ..., header: _Optional[_Union[Header, _Mapping]] = ..., commit: _Optional[_Union[Fragment, _Mapping]] = ..., registers: _Optional[_Union[LabelSet, _Mapping]] = ..., total_chunks: _Optional[int] = ..., delayed_chunks: _Optional[int] = ...) -> None: ...

class ReplicateRequest(_message.Message):
    __slots__ = ("header", "proposal", "registers", "content", "content_delta", "acknowledge")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    PROPOSAL_FIELD_NUMBER: _ClassVar[int]
    REGISTERS_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    CONTENT_DELTA_FIELD_NUMBER: _ClassVar[int]
    ACKNOWLEDGE_FIELD_NUMBER: _ClassVar[int]
    header: Header
    proposal: Fragment
    registers: LabelSet
    content: bytes
    content_delta: int
    acknowledge: bool
    def __init__(self, header: _Optional[_Union[Header, _Mapping]] = ..., proposal: _Optional[_Union[Fragment, _Mapping]] = ..., registers: _Optional[_Union[LabelSet, _Mapping]] = ..., content: _Optional[bytes] = ..., content_delta: _Optional[int] = ..., acknowledge: _Optional[bool] = ...) -> None: ...

class SpoolHead(_message.Message):
    __slots__ = ("acknowledged_end", "registers", "compression_codec", "journal_revision", "committed_end", "committed_registers")
    ACKNOWLEDGED_END_FIELD_NUMBER: _ClassVar[int]
    REGISTERS_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_CODEC_FIELD_NUMBER: _ClassVar[int]
    JOURNAL_REVISION_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_END_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_REGISTERS_FIELD_NUMBER: _ClassVar[int]
    acknowledged_end: int
    registers: LabelSet
    compression_codec: CompressionCodec
    journal_revision: int
    committed_end: int
    committed_registers: LabelSet
    def __init__(self, acknowledged_end: _Optional[int] = ..., registers: _Optional[_Union[LabelSet, _Mapping]] = ..., compression_codec: _Optional[_Union[CompressionCodec, str]] = ..., journal_revision: _Optional[int] = ..., committed_end: _Optional[int] = ..., committed_registers: _Optional[_Union[LabelSet, _Mapping]] = ...) -> None: ...

class ReplicateResponse(_message.Message):
    __slots__ = ("status", "header", "fragment", "registers")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    REGISTERS_FIELD_NUMBER: _ClassVar[int]
    status: Status
    header: Header
    fragment: Fragment
    registers: LabelSet
    def __init__(self, status: _Optional[_Union[Status, str]] = ..., header: _Optional[_Union[Header, _Mapping]] = ..., fragment: _Optional[_Union[Fragment, _Mapping]] = ..., registers: _Optional[_Union[LabelSet, _Mapping]] = ...) -> None: ...

class ListRequest(_message.Message):
    __slots__ = ("selector", "watch")
    SELECTOR_FIELD_NUMBER: _ClassVar[int]
    WATCH_FIELD_NUMBER: _ClassVar[int]
    selector: LabelSelector
    watch: bool
    def __init__(self, selector: _Optional[_Union[LabelSelector, _Mapping]] = ..., watch: _Optional[bool] = ...) -> None: ...

class ListResponse(_message.Message):
    __slots__ = ("status", "header", "journals")
    class Journal(_message.Message):
        __slots__ = ("spec", "mod_revision", "route", "create_revision", "consistent")
        SPEC_FIELD_NUMBER: _ClassVar[int]
        MOD_REVISION_FIELD_NUMBER: _ClassVar[int]
        ROUTE_FIELD_NUMBER: _ClassVar[int]
        CREATE_REVISION_FIELD_NUMBER: _ClassVar[int]
        CONSISTENT_FIELD_NUMBER: _ClassVar[int]
        spec: JournalSpec
        mod_revision: int
        route: Route
        create_revision: int
        consistent: bool
        def __init__(self, spec: _Optional[_Union[JournalSpec, _Mapping]] = ..., mod_revision: _Optional[int] = ..., route: _Optional[_Union[Route, _Mapping]] = ..., create_revision: _Optional[int] = ..., consistent: _Optional[bool] = ...) -> None: ...
    STATUS_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    JOURNALS_FIELD_NUMBER: _ClassVar[int]
    status: Status
    header: Header
    journals: _containers.RepeatedCompositeFieldContainer[ListResponse.Journal]
    def __init__(self, status: _Optional[_Union[Status, str]] = ..., header: _Optional[_Union[Header, _Mapping]] = ..., journals: _Optional[_Iterable[_Union[ListResponse.Journal, _Mapping]]] = ...) -> None: ...

class ApplyRequest(_message.Message):
    __slots__ = ("changes",)
    class Change(_message.Message):
        __slots__ = ("expect_mod_revision", "upsert", "delete")
        EXPECT_MOD_REVISION_FIELD_NUMBER: _ClassVar[int]
        UPSERT_FIELD_NUMBER: _ClassVar[int]
        DELETE_FIELD_NUMBER: _ClassVar[int]
        expect_mod_revision: int
        upsert: JournalSpec
        delete: str
        def __init__(self, expect_mod_revision: _Optional[int] = ..., upsert: _Optional[_Union[JournalSpec, _Mapping]] = ..., delete: _Optional[str] = ...) -> None: ...
    CHANGES_FIELD_NUMBER: _ClassVar[int]
    changes: _containers.RepeatedCompositeFieldContainer[ApplyRequest.Change]
    def __init__(self, changes: _Optional[_Iterable[_Union[ApplyRequest.Change, _Mapping]]] = ...) -> None: ...

class ApplyResponse(_message.Message):
    __slots__ = ("status", "header", "warnings")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    WARNINGS_FIELD_NUMBER: _ClassVar[int]
    status: Status
    header: Header
    warnings: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, status: _Optional[_Union[Status, str]] = ..., header: _Optional[_Union[Header, _Mapping]] = ..., warnings: _Optional[_Iterable[str]] = ...) -> None: ...

class MembersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class MembersResponse(_message.Message):
    __slots__ = ("status", "header", "members")
    class Member(_message.Message):
        __slots__ = ("spec", "journals", "primaries")
        SPEC_FIELD_NUMBER: _ClassVar[int]
        JOURNALS_FIELD_NUMBER: _ClassVar[int]
        PRIMARIES_FIELD_NUMBER: _ClassVar[int]
        spec: BrokerSpec
        journals: int
        primaries: int
        def __init__(self, spec: _Optional[_Union[BrokerSpec, _Mapping]] = ..., journals: _Optional[int] = ..., primaries: _Optional[int] = ...) -> None: ...
    STATUS_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    status: Status
    header: Header
    members: _containers.RepeatedCompositeFieldContainer[MembersResponse.Member]
    def __init__(self, status: _Optional[_Union[Status, str]] = ..., header: _Optional[_Union[Header, _Mapping]] = ..., members: _Optional[_Iterable[_Union[MembersResponse.Member, _Mapping]]] = ...) -> None: ...

class FragmentsRequest(_message.Message):
    __slots__ = ("header", "journal", "do_not_proxy")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    JOURNAL_FIELD_NUMBER: _ClassVar[int]
    DO_NOT_PROXY_FIELD_NUMBER: _ClassVar[int]
    header: Header
    journal: str
    do_not_proxy: bool
    def __init__(self, header: _Optional[_Union[Header, _Mapping]] = ..., journal: _Optional[str] = ..., do_not_proxy: _Optional[bool] = ...) -> None: ...

class FragmentsResponse(_message.Message):
    __slots__ = ("status", "header", "fragments")
    class Entry(_message.Message):
        __slots__ = ("spec", "url")
        SPEC_FIELD_NUMBER: _ClassVar[int]
        URL_FIELD_NUMBER: _ClassVar[int]
        spec: Fragment
        url: str
        def __init__(self, spec: _Optional[_Union[Fragment, _Mapping]] = ..., url: _Optional[str] = ...) -> None: ...
    STATUS_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    FRAGMENTS_FIELD_NUMBER: _ClassVar[int]
    status: Status
    header: Header
    fragments: _containers.RepeatedCompositeFieldContainer[FragmentsResponse.Entry]
    def __init__(self, status: _Optional[_Union[Status, str]] = ..., header: _Optional[_Union[Header, _Mapping]] = ..., fragments: _Optional[_Iterable[_Union[FragmentsResponse.Entry, _Mapping]]] = ...) -> None: ...

class RecordedOp(_message.Message):
    __slots__ = ("seq_no", "checksum", "author", "create", "link", "unlink", "write", "truncate")
    class Create(_message.Message):
        __slots__ = ("path",)
        PATH_FIELD_NUMBER: _ClassVar[int]
        path: str
        def __init__(self, path: _Optional[str] = ...) -> None: ...
    class Link(_message.Message):
        __slots__ = ("fnode", "path")
        FNODE_FIELD_NUMBER: _ClassVar[int]
        PATH_FIELD_NUMBER: _ClassVar[int]
        fnode: int
        path: str
        def __init__(self, fnode: _Optional[int] = ..., path: _Optional[str] = ...) -> None: ...
    class Write(_message.Message):
        __slots__ = ("fnode", "offset", "length")
        FNODE_FIELD_NUMBER: _ClassVar[int]
        OFFSET_FIELD_NUMBER: _ClassVar[int]
        LENGTH_FIELD_NUMBER: _ClassVar[int]
        fnode: int
        offset: int
        length: int
        def __init__(self, fnode: _Optional[int] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...
    class Truncate(_message.Message):
        __slots__ = ("fnode", "size")
        FNODE_FIELD_NUMBER: _ClassVar[int]
        SIZE_FIELD_NUMBER: _ClassVar[int]
        fnode: int
        size: int
        def __init__(self, fnode: _Optional[int] = ..., size: _Optional[int] = ...) -> None: ...
    SEQ_NO_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    AUTHOR_FIELD_NUMBER: _ClassVar[int]
    CREATE_FIELD_NUMBER: _ClassVar[int]
    LINK_FIELD_NUMBER: _ClassVar[int]
    UNLINK_FIELD_NUMBER: _ClassVar[int]
    WRITE_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_FIELD_NUMBER: _ClassVar[int]
    seq_no: int
    checksum: int
    author: int
    create: RecordedOp.Create
    link: RecordedOp.Link
    unlink: RecordedOp.Link
    write: RecordedOp.Write
    truncate: RecordedOp.Truncate
    def __init__(self, seq_no: _Optional[int] = ..., checksum: _Optional[int] = ..., author: _Optional[int] = ..., create: _Optional[_Union[RecordedOp.Create, _Mapping]] = ..., link: _Optional[_Union[RecordedOp.Link, _Mapping]] = ..., unlink: _Optional[_Union[RecordedOp.Link, _Mapping]] = ..., write: _Optional[_Union[RecordedOp.Write, _Mapping]] = ..., truncate: _Optional[_Union[RecordedOp.Truncate, _Mapping]] = ...) -> None: ...

class Segment(_message.Message):
    __slots__ = ("author", "first_seq_no", "first_offset", "first_checksum", "last_seq_no", "last_offset", "log")
    AUTHOR_FIELD_NUMBER: _ClassVar[int]
    FIRST_SEQ_NO_FIELD_NUMBER: _ClassVar[int]
    FIRST_OFFSET_FIELD_NUMBER: _ClassVar[int]
    FIRST_CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQ_NO_FIELD_NUMBER: _ClassVar[int]
    LAST_OFFSET_FIELD_NUMBER: _ClassVar[int]
    LOG_FIELD_NUMBER: _ClassVar[int]
    author: int
    first_seq_no: int
    first_offset: int
    first_checksum: int
    last_seq_no: int
    last_offset: int
    log: str
    def __init__(self, author: _Optional[int] = ..., first_seq_no: _Optional[int] = ..., first_offset: _Optional[int] = ..., first_checksum: _Optional[int] = ..., last_seq_no: _Optional[int] = ..., last_offset: _Optional[int] = ..., log: _Optional[str] = ...) -> None: ...

class FnodeSegments(_message.Message):
    __slots__ = ("fnode", "segments")
    FNODE_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    fnode: int
    segments: _containers.RepeatedCompositeFieldContainer[Segment]
    def __init__(self, fnode: _Optional[int] = ..., segments: _Optional[_Iterable[_Union[Segment, _Mapping]]] = ...) -> None: ...

class FSMHints(_message.Message):
    __slots__ = ("log", "live_nodes")
    LOG_FIELD_NUMBER: _ClassVar[int]
    LIVE_NODES_FIELD_NUMBER: _ClassVar[int]
    log: str
    live_nodes: _containers.RepeatedCompositeFieldContainer[FnodeSegments]
    def __init__(self, log: _Optional[str] = ..., live_nodes: _Optional[_Iterable[_Union[FnodeSegments, _Mapping]]] = ...) -> None: ...

class StatRequest(_message.Message):
    __slots__ = ("header", "shard", "read_through", "any_replica")
    class ReadThroughEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    HEADER_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    READ_THROUGH_FIELD_NUMBER: _ClassVar[int]
    ANY_REPLICA_FIELD_NUMBER: _ClassVar[int]
    header: Header
    shard: str
    read_through: _containers.ScalarMap[str, int]
    any_replica: bool
    def __init__(self, header: _Optional[_Union[Header, _Mapping]] = ..., shard: _Optional[str] = ..., read_through: _Optional[_Mapping[str, int]] = ..., any_replica: _Optional[bool] = ...) -> None: ...

class StatResponse(_message.Message):
    __slots__ = ("status", "header", "read_through", "publish_at", "detail", "recovery_log")
    class ReadThroughEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class PublishAtEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class RecoveryLog(_message.Message):
        __slots__ = ("journal", "offset")
        JOURNAL_FIELD_NUMBER: _ClassVar[int]
        OFFSET_FIELD_NUMBER: _ClassVar[int]
        journal: str
        offset: int
        def __init__(self, journal: _Optional[str] = ..., offset: _Optional[int] = ...) -> None: ...
    STATUS_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    READ_THROUGH_FIELD_NUMBER: _ClassVar[int]
    PUBLISH_AT_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    RECOVERY_LOG_FIELD_NUMBER: _ClassVar[int]
    status: Status
    header: Header
    read_through: _containers.ScalarMap[str, int]
    publish_at: _containers.ScalarMap[str, int]
    detail: str
    recovery_log: StatResponse.RecoveryLog
    def __init__(self, status: _Optional[_Union[Status, str]] = ..., header: _Optional[_Union[Header, _Mapping]] = ..., read_through: _Optional[_Mapping[str, int]] = ..., publish_at: _Optional[_Mapping[str, int]] = ..., detail: _Optional[str] = ..., recovery_log: _Optional[_Union[StatResponse.RecoveryLog, _Mapping]] = ...) -> None: ...

class ShardListRequest(_message.Message):
    __slots__ = ("selector",)
    SELECTOR_FIELD_NUMBER: _ClassVar[int]
    selector: LabelSelector
    def __init__(self, selector: _Optional[_Union[LabelSelector, _Mapping]] = ...) -> None: ...

class ShardListResponse(_message.Message):
    __slots__ = ("status", "header", "shards")
    class Shard(_message.Message):
        __slots__ = ("spec", "mod_revision", "route", "status", "create_revision")
        SPEC_FIELD_NUMBER: _ClassVar[int]
        MOD_REVISION_FIELD_NUMBER: _ClassVar[int]
        ROUTE_FIELD_NUMBER: _ClassVar[int]
        STATUS_FIELD_NUMBER: _ClassVar[int]
        CREATE_REVISION_FIELD_NUMBER: _ClassVar[int]
        spec: ShardSpec
        mod_revision: int
        route: Route
        status: _containers.RepeatedCompositeFieldContainer[ReplicaStatus]
        create_revision: int
        def __init__(self, spec: _Optional[_Union[ShardSpec, _Mapping]] = ..., mod_revision: _Optional[int] = ..., route: _Optional[_Union[Route, _Mapping]] = ..., status: _Optional[_Iterable[_Union[ReplicaStatus, _Mapping]]] = ..., create_revision: _Optional[int] = ...) -> None: ...
    STATUS_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    status: Status
    header: Header
    shards: _containers.RepeatedCompositeFieldContainer[ShardListResponse.Shard]
    def __init__(self, status: _Optional[_Union[Status, str]] = ..., header: _Optional[_Union[Header, _Mapping]] = ..., shards: _Optional[_Iterable[_Union[ShardListResponse.Shard, _Mapping]]] = ...) -> None: ...

class ShardApplyRequest(_message.Message):
    __slots__ = ("changes",)
    class Change(_message.Message):
        __slots__ = ("expect_mod_revision", "upsert", "delete")
        EXPECT_MOD_REVISION_FIELD_NUMBER: _ClassVar[int]
        UPSERT_FIELD_NUMBER: _ClassVar[int]
        DELETE_FIELD_NUMBER: _ClassVar[int]
        expect_mod_revision: int
        upsert: ShardSpec
        delete: str
        def __init__(self, expect_mod_revision: _Optional[int] = ..., upsert: _Optional[_Union[ShardSpec, _Mapping]] = ..., delete: _Optional[str] = ...) -> None: ...
    CHANGES_FIELD_NUMBER: _ClassVar[int]
    changes: _containers.RepeatedCompositeFieldContainer[ShardApplyRequest.Change]
    def __init__(self, changes: _Optional[_Iterable[_Union[ShardApplyRequest.Change, _Mapping]]] = ...) -> None: ...

class ShardApplyResponse(_message.Message):
    __slots__ = ("status", "header", "detail")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    status: Status
    header: Header
    detail: str
    def __init__(self, status: _Optional[_Union[Status, str]] = ..., header: _Optional[_Union[Header, _Mapping]] = ..., detail: _Optional[str] = ...) -> None: ...

class UnassignRequest(_message.Message):
    __slots__ = ("shards", "only_failed", "dry_run")
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    ONLY_FAILED_FIELD_NUMBER: _ClassVar[int]
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    shards: _containers.RepeatedScalarFieldContainer[str]
    only_failed: bool
    dry_run: bool
    def __init__(self, shards: _Optional[_Iterable[str]] = ..., only_failed: _Optional[bool] = ..., dry_run: _Optional[bool] = ...) -> None: ...

class UnassignResponse(_message.Message):
    __slots__ = ("status", "shards")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    status: Status
    shards: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, status: _Optional[_Union[Status, str]] = ..., shards: _Optional[_Iterable[str]] = ...) -> None: ...

class GetHintsRequest(_message.Message):
    __slots__ = ("shard",)
    SHARD_FIELD_NUMBER: _ClassVar[int]
    shard: str
    def __init__(self, shard: _Optional[str] = ...) -> None: ...

class GetHintsResponse(_message.Message):
    __slots__ = ("status", "header", "primary_hints", "backup_hints", "log", "detail")
    class ResponseHints(_message.Message):
        __slots__ = ("hints", "key", "error")
        HINTS_FIELD_NUMBER: _ClassVar[int]
        KEY_FIELD_NUMBER: _ClassVar[int]
        ERROR_FIELD_NUMBER: _ClassVar[int]
        hints: FSMHints
        key: str
        error: str
        def __init__(self, hints: _Optional[_Union[FSMHints, _Mapping]] = ..., key: _Optional[str] = ..., error: _Optional[str] = ...) -> None: ...
    STATUS_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    PRIMARY_HINTS_FIELD_NUMBER: _ClassVar[int]
    BACKUP_HINTS_FIELD_NUMBER: _ClassVar[int]
    LOG_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    status: Status
    header: Header
    primary_hints: GetHintsResponse.ResponseHints
    backup_hints: _containers.RepeatedCompositeFieldContainer[GetHintsResponse.ResponseHints]
    log: str
    detail: str
    def __init__(self, status: _Optional[_Union[Status, str]] = ..., header: _Optional[_Union[Header, _Mapping]] = ..., primary_hints: _Optional[_Union[GetHintsResponse.ResponseHints, _Mapping]] = ..., backup_hints: _Optional[_Iterable[_Union[GetHintsResponse.ResponseHints, _Mapping]]] = ..., log: _Optional[str] = ..., detail: _Optional[str] = ...) -> None: ...

class Mutation(_message.Message):
    __slots__ = ("key", "value", "delete")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    DELETE_FIELD_NUMBER: _ClassVar[int]
    key: str
    value: bytes
    delete: bool
    def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ..., delete: _Optional[bool] = ...) -> None: ...

class TargetEntry(_message.Message):
    __slots__ = ("index", "mutations", "dispatched_ns", "committed_ns")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    MUTATIONS_FIELD_NUMBER: _ClassVar[int]
    DISPATCHED_NS_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_NS_FIELD_NUMBER: _ClassVar[int]
    index: int
    mutations: _containers.RepeatedCompositeFieldContainer[Mutation]
    dispatched_ns: int
    committed_ns: int
    def __init__(self, index: _Optional[int] = ..., mutations: _Optional[_Iterable[_Union[Mutation, _Mapping]]] = ..., dispatched_ns: _Optional[int] = ..., committed_ns: _Optional[int] = ...) -> None: ...

class DeliverRequest(_message.Message):
    __slots__ = ("open", "prev_index", "entries")
    class Open(_message.Message):
        __slots__ = ("target", "player", "epoch", "nonce", "wal")
        TARGET_FIELD_NUMBER: _ClassVar[int]
        PLAYER_FIELD_NUMBER: _ClassVar[int]
        EPOCH_FIELD_NUMBER: _ClassVar[int]
        NONCE_FIELD_NUMBER: _ClassVar[int]
        WAL_FIELD_NUMBER: _ClassVar[int]
        target: str
        player: str
        epoch: int
        nonce: int
        wal: str
        def __init__(self, target: _Optional[str] = ..., player: _Optional[str] = ..., epoch: _Optional[int] = ..., nonce: _Optional[int] = ..., wal: _Optional[str] = ...) -> None: ...
    OPEN_FIELD_NUMBER: _ClassVar[int]
    PREV_INDEX_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    open: DeliverRequest.Open
    prev_index: int
    entries: _containers.RepeatedCompositeFieldContainer[TargetEntry]
    def __init__(self, open: _Optional[_Union[DeliverRequest.Open, _Mapping]] = ..., prev_index: _Optional[int] = ..., entries: _Optional[_Iterable[_Union[TargetEntry, _Mapping]]] = ...) -> None: ...

class DeliverResponse(_message.Message):
    __slots__ = ("status", "last_applied", "detail")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    LAST_APPLIED_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    status: Status
    last_applied: int
    detail: str
    def __init__(self, status: _Optional[_Union[Status, str]] = ..., last_applied: _Optional[int] = ..., detail: _Optional[str] = ...) -> None: ...

class LastAckRequest(_message.Message):
    __slots__ = ("target",)
    TARGET_FIELD_NUMBER: _ClassVar[int]
    target: str
    def __init__(self, target: _Optional[str] = ...) -> None: ...

class LastAckResponse(_message.Message):
    __slots__ = ("status", "last_applied", "epoch", "detail", "data_port")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    LAST_APPLIED_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    status: Status
    last_applied: int
    epoch: int
    detail: str
    data_port: int
    def __init__(self, status: _Optional[_Union[Status, str]] = ..., last_applied: _Optional[int] = ..., epoch: _Optional[int] = ..., detail: _Optional[str] = ..., data_port: _Optional[int] = ...) -> None: ...
