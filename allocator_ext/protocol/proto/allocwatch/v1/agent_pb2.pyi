from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ProtocolVersion(_message.Message):
    __slots__ = ("major", "minor")
    MAJOR_FIELD_NUMBER: _ClassVar[int]
    MINOR_FIELD_NUMBER: _ClassVar[int]
    major: int
    minor: int
    def __init__(self, major: _Optional[int] = ..., minor: _Optional[int] = ...) -> None: ...

class AgentMessage(_message.Message):
    __slots__ = ("hello", "report", "command_result", "goodbye")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    REPORT_FIELD_NUMBER: _ClassVar[int]
    COMMAND_RESULT_FIELD_NUMBER: _ClassVar[int]
    GOODBYE_FIELD_NUMBER: _ClassVar[int]
    hello: Hello
    report: Report
    command_result: CommandResult
    goodbye: Goodbye
    def __init__(self, hello: _Optional[_Union[Hello, _Mapping]] = ..., report: _Optional[_Union[Report, _Mapping]] = ..., command_result: _Optional[_Union[CommandResult, _Mapping]] = ..., goodbye: _Optional[_Union[Goodbye, _Mapping]] = ...) -> None: ...

class Hello(_message.Message):
    __slots__ = ("protocol_version", "identity")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    protocol_version: ProtocolVersion
    identity: Identity
    def __init__(self, protocol_version: _Optional[_Union[ProtocolVersion, _Mapping]] = ..., identity: _Optional[_Union[Identity, _Mapping]] = ...) -> None: ...

class Identity(_message.Message):
    __slots__ = ("instance_id", "pid", "host", "rank", "local_rank", "world_size", "cuda_device", "gpu_uuid", "training_job", "pod", "namespace", "node", "backend", "torch_version", "cuda_version", "agent_version", "process_start_time_seconds")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    CUDA_DEVICE_FIELD_NUMBER: _ClassVar[int]
    GPU_UUID_FIELD_NUMBER: _ClassVar[int]
    TRAINING_JOB_FIELD_NUMBER: _ClassVar[int]
    POD_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    TORCH_VERSION_FIELD_NUMBER: _ClassVar[int]
    CUDA_VERSION_FIELD_NUMBER: _ClassVar[int]
    AGENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    PROCESS_START_TIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    pid: int
    host: str
    rank: int
    local_rank: int
    world_size: int
    cuda_device: int
    gpu_uuid: str
    training_job: str
    pod: str
    namespace: str
    node: str
    backend: str
    torch_version: str
    cuda_version: str
    agent_version: str
    process_start_time_seconds: float
    def __init__(self, instance_id: _Optional[str] = ..., pid: _Optional[int] = ..., host: _Optional[str] = ..., rank: _Optional[int] = ..., local_rank: _Optional[int] = ..., world_size: _Optional[int] = ..., cuda_device: _Optional[int] = ..., gpu_uuid: _Optional[str] = ..., training_job: _Optional[str] = ..., pod: _Optional[str] = ..., namespace: _Optional[str] = ..., node: _Optional[str] = ..., backend: _Optional[str] = ..., torch_version: _Optional[str] = ..., cuda_version: _Optional[str] = ..., agent_version: _Optional[str] = ..., process_start_time_seconds: _Optional[float] = ...) -> None: ...

class Report(_message.Message):
    __slots__ = ("sequence", "timestamp_seconds", "devices", "agent")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    AGENT_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    timestamp_seconds: float
    devices: _containers.RepeatedCompositeFieldContainer[DeviceReport]
    agent: AgentCounters
    def __init__(self, sequence: _Optional[int] = ..., timestamp_seconds: _Optional[float] = ..., devices: _Optional[_Iterable[_Union[DeviceReport, _Mapping]]] = ..., agent: _Optional[_Union[AgentCounters, _Mapping]] = ...) -> None: ...

class AgentCounters(_message.Message):
    __slots__ = ("reports_sampled_total", "reports_dropped_total", "sample_errors_total", "reconnects_total")
    REPORTS_SAMPLED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    REPORTS_DROPPED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_ERRORS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    RECONNECTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    reports_sampled_total: int
    reports_dropped_total: int
    sample_errors_total: int
    reconnects_total: int
    def __init__(self, reports_sampled_total: _Optional[int] = ..., reports_dropped_total: _Optional[int] = ..., sample_errors_total: _Optional[int] = ..., reconnects_total: _Optional[int] = ...) -> None: ...

class DeviceReport(_message.Message):
    __slots__ = ("cuda_device", "gpu_uuid", "allocator", "settings", "device_memory", "interval_peaks")
    CUDA_DEVICE_FIELD_NUMBER: _ClassVar[int]
    GPU_UUID_FIELD_NUMBER: _ClassVar[int]
    ALLOCATOR_FIELD_NUMBER: _ClassVar[int]
    SETTINGS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_MEMORY_FIELD_NUMBER: _ClassVar[int]
    INTERVAL_PEAKS_FIELD_NUMBER: _ClassVar[int]
    cuda_device: int
    gpu_uuid: str
    allocator: AllocatorStats
    settings: AllocatorSettings
    device_memory: DeviceMemory
    interval_peaks: IntervalPeaks
    def __init__(self, cuda_device: _Optional[int] = ..., gpu_uuid: _Optional[str] = ..., allocator: _Optional[_Union[AllocatorStats, _Mapping]] = ..., settings: _Optional[_Union[AllocatorSettings, _Mapping]] = ..., device_memory: _Optional[_Union[DeviceMemory, _Mapping]] = ..., interval_peaks: _Optional[_Union[IntervalPeaks, _Mapping]] = ...) -> None: ...

class IntervalPeaks(_message.Message):
    __slots__ = ("peak_allocated_bytes", "peak_reserved_bytes", "window")
    class Window(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        WINDOW_UNSPECIFIED: _ClassVar[IntervalPeaks.Window]
        INTERVAL: _ClassVar[IntervalPeaks.Window]
        SINCE_RESET: _ClassVar[IntervalPeaks.Window]
    WINDOW_UNSPECIFIED: IntervalPeaks.Window
    INTERVAL: IntervalPeaks.Window
    SINCE_RESET: IntervalPeaks.Window
    PEAK_ALLOCATED_BYTES_FIELD_NUMBER: _ClassVar[int]
    PEAK_RESERVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    window: IntervalPeaks.Window
    def __init__(self, peak_allocated_bytes: _Optional[int] = ..., peak_reserved_bytes: _Optional[int] = ..., window: _Optional[_Union[IntervalPeaks.Window, str]] = ...) -> None: ...

class PoolStats(_message.Message):
    __slots__ = ("allocated_bytes", "reserved_bytes", "active_bytes", "requested_bytes", "inactive_split_bytes", "segments", "peak_allocated_bytes", "peak_reserved_bytes")
    ALLOCATED_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESERVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_BYTES_FIELD_NUMBER: _ClassVar[int]
    REQUESTED_BYTES_FIELD_NUMBER: _ClassVar[int]
    INACTIVE_SPLIT_BYTES_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    PEAK_ALLOCATED_BYTES_FIELD_NUMBER: _ClassVar[int]
    PEAK_RESERVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    allocated_bytes: int
    reserved_bytes: int
    active_bytes: int
    requested_bytes: int
    inactive_split_bytes: int
    segments: int
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    def __init__(self, allocated_bytes: _Optional[int] = ..., reserved_bytes: _Optional[int] = ..., active_bytes: _Optional[int] = ..., requested_bytes: _Optional[int] = ..., inactive_split_bytes: _Optional[int] = ..., segments: _Optional[int] = ..., peak_allocated_bytes: _Optional[int] = ..., peak_reserved_bytes: _Optional[int] = ...) -> None: ...

class AllocatorStats(_message.Message):
    __slots__ = ("all", "small_pool", "large_pool", "pending_free_bytes", "pending_events", "pending_unmap_bytes", "alloc_retries", "ooms", "device_mallocs", "device_frees", "sync_all_streams", "gc_reclaims", "gc_reclaimed_bytes", "empty_cache_calls", "allocations", "largest_free_block_bytes", "host_waits_device", "host_waits_stream", "host_waits_event", "stream_waits", "device_calls_segment_alloc", "device_calls_segment_free", "device_calls_create", "device_calls_release", "device_calls_map", "device_calls_set_access", "device_calls_unmap", "host_waits_unmap_thread")
    ALL_FIELD_NUMBER: _ClassVar[int]
    SMALL_POOL_FIELD_NUMBER: _ClassVar[int]
    LARGE_POOL_FIELD_NUMBER: _ClassVar[int]
    PENDING_FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PENDING_EVENTS_FIELD_NUMBER: _ClassVar[int]
    PENDING_UNMAP_BYTES_FIELD_NUMBER: _ClassVar[int]
    ALLOC_RETRIES_FIELD_NUMBER: _ClassVar[int]
    OOMS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_MALLOCS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FREES_FIELD_NUMBER: _ClassVar[int]
    SYNC_ALL_STREAMS_FIELD_NUMBER: _ClassVar[int]
    GC_RECLAIMS_FIELD_NUMBER: _ClassVar[int]
    GC_RECLAIMED_BYTES_FIELD_NUMBER: _ClassVar[int]
    EMPTY_CACHE_CALLS_FIELD_NUMBER: _ClassVar[int]
    ALLOCATIONS_FIELD_NUMBER: _ClassVar[int]
    LARGEST_FREE_BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    HOST_WAITS_DEVICE_FIELD_NUMBER: _ClassVar[int]
    HOST_WAITS_STREAM_FIELD_NUMBER: _ClassVar[int]
    HOST_WAITS_EVENT_FIELD_NUMBER: _ClassVar[int]
    STREAM_WAITS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_CALLS_SEGMENT_ALLOC_FIELD_NUMBER: _ClassVar[int]
    DEVICE_CALLS_SEGMENT_FREE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_CALLS_CREATE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_CALLS_RELEASE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_CALLS_MAP_FIELD_NUMBER: _ClassVar[int]
    DEVICE_CALLS_SET_ACCESS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_CALLS_UNMAP_FIELD_NUMBER: _ClassVar[int]
    HOST_WAITS_UNMAP_THREAD_FIELD_NUMBER: _ClassVar[int]
    all: PoolStats
    small_pool: PoolStats
    large_pool: PoolStats
    pending_free_bytes: int
    pending_events: int
    pending_unmap_bytes: int
    alloc_retries: int
    ooms: int
    device_mallocs: int
    device_frees: int
    sync_all_streams: int
    gc_reclaims: int
    gc_reclaimed_bytes: int
    empty_cache_calls: int
    allocations: int
    largest_free_block_bytes: int
    host_waits_device: int
    host_waits_stream: int
    host_waits_event: int
    stream_waits: int
    device_calls_segment_alloc: int
    device_calls_segment_free: int
    device_calls_create: int
    device_calls_release: int
    device_calls_map: int
    device_calls_set_access: int
    device_calls_unmap: int
    host_waits_unmap_thread: int
    def __init__(self, all: _Optional[_Union[PoolStats, _Mapping]] = ..., small_pool: _Optional[_Union[PoolStats, _Mapping]] = ..., large_pool: _Optional[_Union[PoolStats, _Mapping]] = ..., pending_free_bytes: _Optional[int] = ..., pending_events: _Optional[int] = ..., pending_unmap_bytes: _Optional[int] = ..., alloc_retries: _Optional[int] = ..., ooms: _Optional[int] = ..., device_mallocs: _Optional[int] = ..., device_frees: _Optional[int] = ..., sync_all_streams: _Optional[int] = ..., gc_reclaims: _Optional[int] = ..., gc_reclaimed_bytes: _Optional[int] = ..., empty_cache_calls: _Optional[int] = ..., allocations: _Optional[int] = ..., largest_free_block_bytes: _Optional[int] = ..., host_waits_device: _Optional[int] = ..., host_waits_stream: _Optional[int] = ..., host_waits_event: _Optional[int] = ..., stream_waits: _Optional[int] = ..., device_calls_segment_alloc: _Optional[int] = ..., device_calls_segment_free: _Optional[int] = ..., device_calls_create: _Optional[int] = ..., device_calls_release: _Optional[int] = ..., device_calls_map: _Optional[int] = ..., device_calls_set_access: _Optional[int] = ..., device_calls_unmap: _Optional[int] = ..., host_waits_unmap_thread: _Optional[int] = ...) -> None: ...

class AllocatorSettings(_message.Message):
    __slots__ = ("garbage_collection_threshold", "max_split_size_bytes", "expandable_segments", "config_string")
    GARBAGE_COLLECTION_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    MAX_SPLIT_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    EXPANDABLE_SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    CONFIG_STRING_FIELD_NUMBER: _ClassVar[int]
    garbage_collection_threshold: float
    max_split_size_bytes: int
    expandable_segments: bool
    config_string: str
    def __init__(self, garbage_collection_threshold: _Optional[float] = ..., max_split_size_bytes: _Optional[int] = ..., expandable_segments: bool = ..., config_string: _Optional[str] = ...) -> None: ...

class DeviceMemory(_message.Message):
    __slots__ = ("total_bytes", "used_bytes", "has_process_used_bytes", "process_used_bytes")
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    HAS_PROCESS_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    PROCESS_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    total_bytes: int
    used_bytes: int
    has_process_used_bytes: bool
    process_used_bytes: int
    def __init__(self, total_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., has_process_used_bytes: bool = ..., process_used_bytes: _Optional[int] = ...) -> None: ...

class CommandResult(_message.Message):
    __slots__ = ("command_id", "status", "message", "bytes_released", "sync_seconds", "snapshot_path", "snapshot_bytes", "settings_in_force")
    class Status(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STATUS_UNSPECIFIED: _ClassVar[CommandResult.Status]
        OK: _ClassVar[CommandResult.Status]
        INVALID_ARGUMENT: _ClassVar[CommandResult.Status]
        UNSUPPORTED: _ClassVar[CommandResult.Status]
        FAILED: _ClassVar[CommandResult.Status]
    STATUS_UNSPECIFIED: CommandResult.Status
    OK: CommandResult.Status
    INVALID_ARGUMENT: CommandResult.Status
    UNSUPPORTED: CommandResult.Status
    FAILED: CommandResult.Status
    COMMAND_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    BYTES_RELEASED_FIELD_NUMBER: _ClassVar[int]
    SYNC_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_PATH_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    SETTINGS_IN_FORCE_FIELD_NUMBER: _ClassVar[int]
    command_id: int
    status: CommandResult.Status
    message: str
    bytes_released: int
    sync_seconds: float
    snapshot_path: str
    snapshot_bytes: int
    settings_in_force: _containers.RepeatedCompositeFieldContainer[DeviceSettings]
    def __init__(self, command_id: _Optional[int] = ..., status: _Optional[_Union[CommandResult.Status, str]] = ..., message: _Optional[str] = ..., bytes_released: _Optional[int] = ..., sync_seconds: _Optional[float] = ..., snapshot_path: _Optional[str] = ..., snapshot_bytes: _Optional[int] = ..., settings_in_force: _Optional[_Iterable[_Union[DeviceSettings, _Mapping]]] = ...) -> None: ...

class DeviceSettings(_message.Message):
    __slots__ = ("cuda_device", "settings")
    CUDA_DEVICE_FIELD_NUMBER: _ClassVar[int]
    SETTINGS_FIELD_NUMBER: _ClassVar[int]
    cuda_device: int
    settings: AllocatorSettings
    def __init__(self, cuda_device: _Optional[int] = ..., settings: _Optional[_Union[AllocatorSettings, _Mapping]] = ...) -> None: ...

class Goodbye(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class SidecarMessage(_message.Message):
    __slots__ = ("welcome", "command")
    WELCOME_FIELD_NUMBER: _ClassVar[int]
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    welcome: Welcome
    command: Command
    def __init__(self, welcome: _Optional[_Union[Welcome, _Mapping]] = ..., command: _Optional[_Union[Command, _Mapping]] = ...) -> None: ...

class Welcome(_message.Message):
    __slots__ = ("protocol_version", "sidecar_version", "agent_key")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    SIDECAR_VERSION_FIELD_NUMBER: _ClassVar[int]
    AGENT_KEY_FIELD_NUMBER: _ClassVar[int]
    protocol_version: ProtocolVersion
    sidecar_version: str
    agent_key: str
    def __init__(self, protocol_version: _Optional[_Union[ProtocolVersion, _Mapping]] = ..., sidecar_version: _Optional[str] = ..., agent_key: _Optional[str] = ...) -> None: ...

class Command(_message.Message):
    __slots__ = ("id", "cuda_device", "set_config", "reclaim", "reset_peaks", "snapshot", "record_history")
    ID_FIELD_NUMBER: _ClassVar[int]
    CUDA_DEVICE_FIELD_NUMBER: _ClassVar[int]
    SET_CONFIG_FIELD_NUMBER: _ClassVar[int]
    RECLAIM_FIELD_NUMBER: _ClassVar[int]
    RESET_PEAKS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    RECORD_HISTORY_FIELD_NUMBER: _ClassVar[int]
    id: int
    cuda_device: int
    set_config: SetConfig
    reclaim: Reclaim
    reset_peaks: ResetPeaks
    snapshot: Snapshot
    record_history: RecordHistory
    def __init__(self, id: _Optional[int] = ..., cuda_device: _Optional[int] = ..., set_config: _Optional[_Union[SetConfig, _Mapping]] = ..., reclaim: _Optional[_Union[Reclaim, _Mapping]] = ..., reset_peaks: _Optional[_Union[ResetPeaks, _Mapping]] = ..., snapshot: _Optional[_Union[Snapshot, _Mapping]] = ..., record_history: _Optional[_Union[RecordHistory, _Mapping]] = ...) -> None: ...

class SetConfig(_message.Message):
    __slots__ = ("settings",)
    SETTINGS_FIELD_NUMBER: _ClassVar[int]
    settings: str
    def __init__(self, settings: _Optional[str] = ...) -> None: ...

class Reclaim(_message.Message):
    __slots__ = ("mode",)
    class Mode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        MODE_UNSPECIFIED: _ClassVar[Reclaim.Mode]
        GARBAGE_COLLECT: _ClassVar[Reclaim.Mode]
        EMPTY_CACHE: _ClassVar[Reclaim.Mode]
    MODE_UNSPECIFIED: Reclaim.Mode
    GARBAGE_COLLECT: Reclaim.Mode
    EMPTY_CACHE: Reclaim.Mode
    MODE_FIELD_NUMBER: _ClassVar[int]
    mode: Reclaim.Mode
    def __init__(self, mode: _Optional[_Union[Reclaim.Mode, str]] = ...) -> None: ...

class ResetPeaks(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Snapshot(_message.Message):
    __slots__ = ("include_frames", "max_bytes")
    INCLUDE_FRAMES_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    include_frames: bool
    max_bytes: int
    def __init__(self, include_frames: bool = ..., max_bytes: _Optional[int] = ...) -> None: ...

class RecordHistory(_message.Message):
    __slots__ = ("enabled", "max_entries")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    MAX_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    max_entries: int
    def __init__(self, enabled: bool = ..., max_entries: _Optional[int] = ...) -> None: ...
