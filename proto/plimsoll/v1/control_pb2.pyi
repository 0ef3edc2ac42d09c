import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from plimsoll.v1 import inference_pb2 as _inference_pb2
from plimsoll.v1 import types_pb2 as _types_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AdmitVerdict(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ADMIT_VERDICT_UNSPECIFIED: _ClassVar[AdmitVerdict]
    ADMIT_VERDICT_ADMIT: _ClassVar[AdmitVerdict]
    ADMIT_VERDICT_ADMIT_AFTER_SHEDDING: _ClassVar[AdmitVerdict]
    ADMIT_VERDICT_WAIT: _ClassVar[AdmitVerdict]
    ADMIT_VERDICT_REJECT: _ClassVar[AdmitVerdict]

class AdmitConstraint(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ADMIT_CONSTRAINT_UNSPECIFIED: _ClassVar[AdmitConstraint]
    ADMIT_CONSTRAINT_SHED_LINE: _ClassVar[AdmitConstraint]
    ADMIT_CONSTRAINT_ADMISSION_LIMIT: _ClassVar[AdmitConstraint]
    ADMIT_CONSTRAINT_RESERVATIONS: _ClassVar[AdmitConstraint]
    ADMIT_CONSTRAINT_PREFILL_EXCEEDS_CEILING: _ClassVar[AdmitConstraint]
    ADMIT_CONSTRAINT_PAUSED_AT_SOFT: _ClassVar[AdmitConstraint]
    ADMIT_CONSTRAINT_PAUSED_AT_HARD: _ClassVar[AdmitConstraint]
    ADMIT_CONSTRAINT_PAUSED_AT_EMERGENCY: _ClassVar[AdmitConstraint]
    ADMIT_CONSTRAINT_QUEUE_FULL: _ClassVar[AdmitConstraint]
    ADMIT_CONSTRAINT_IN_FLIGHT_LIMIT: _ClassVar[AdmitConstraint]
    ADMIT_CONSTRAINT_HYPER_CAP: _ClassVar[AdmitConstraint]
    ADMIT_CONSTRAINT_ADMISSION_CAP: _ClassVar[AdmitConstraint]

class EnforcerActionKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ENFORCER_ACTION_KIND_UNSPECIFIED: _ClassVar[EnforcerActionKind]
    ENFORCER_ACTION_KIND_CLEAR_AUX_CACHES: _ClassVar[EnforcerActionKind]
    ENFORCER_ACTION_KIND_PRESSURE_RECLAIM: _ClassVar[EnforcerActionKind]
    ENFORCER_ACTION_KIND_IDLE_RECLAIM: _ClassVar[EnforcerActionKind]
    ENFORCER_ACTION_KIND_SHRINK_SESSIONS: _ClassVar[EnforcerActionKind]
    ENFORCER_ACTION_KIND_EXPIRE_SESSIONS: _ClassVar[EnforcerActionKind]
    ENFORCER_ACTION_KIND_EVICT_MODEL: _ClassVar[EnforcerActionKind]
    ENFORCER_ACTION_KIND_ABORT_REQUESTS: _ClassVar[EnforcerActionKind]
    ENFORCER_ACTION_KIND_MARK_PENDING_UNLOAD: _ClassVar[EnforcerActionKind]
    ENFORCER_ACTION_KIND_ABORT_LOAD: _ClassVar[EnforcerActionKind]
    ENFORCER_ACTION_KIND_PREFILL_ABORT: _ClassVar[EnforcerActionKind]
    ENFORCER_ACTION_KIND_REFUSE_ADMISSION: _ClassVar[EnforcerActionKind]
    ENFORCER_ACTION_KIND_REFUSE_LOAD: _ClassVar[EnforcerActionKind]
    ENFORCER_ACTION_KIND_PAUSE_ADMISSION: _ClassVar[EnforcerActionKind]
    ENFORCER_ACTION_KIND_RESUME_ADMISSION: _ClassVar[EnforcerActionKind]
    ENFORCER_ACTION_KIND_STORE_CACHE_CAP: _ClassVar[EnforcerActionKind]
    ENFORCER_ACTION_KIND_BATCH_CAP: _ClassVar[EnforcerActionKind]

class ModelState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODEL_STATE_UNSPECIFIED: _ClassVar[ModelState]
    MODEL_STATE_LOADING: _ClassVar[ModelState]
    MODEL_STATE_READY: _ClassVar[ModelState]
    MODEL_STATE_UNLOADING: _ClassVar[ModelState]
    MODEL_STATE_UNLOADED: _ClassVar[ModelState]

class SessionTier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SESSION_TIER_UNSPECIFIED: _ClassVar[SessionTier]
    SESSION_TIER_RAM: _ClassVar[SessionTier]
    SESSION_TIER_DISK: _ClassVar[SessionTier]
ADMIT_VERDICT_UNSPECIFIED: AdmitVerdict
ADMIT_VERDICT_ADMIT: AdmitVerdict
ADMIT_VERDICT_ADMIT_AFTER_SHEDDING: AdmitVerdict
ADMIT_VERDICT_WAIT: AdmitVerdict
ADMIT_VERDICT_REJECT: AdmitVerdict
ADMIT_CONSTRAINT_UNSPECIFIED: AdmitConstraint
ADMIT_CONSTRAINT_SHED_LINE: AdmitConstraint
ADMIT_CONSTRAINT_ADMISSION_LIMIT: AdmitConstraint
ADMIT_CONSTRAINT_RESERVATIONS: AdmitConstraint
ADMIT_CONSTRAINT_PREFILL_EXCEEDS_CEILING: AdmitConstraint
ADMIT_CONSTRAINT_PAUSED_AT_SOFT: AdmitConstraint
ADMIT_CONSTRAINT_PAUSED_AT_HARD: AdmitConstraint
ADMIT_CONSTRAINT_PAUSED_AT_EMERGENCY: AdmitConstraint
ADMIT_CONSTRAINT_QUEUE_FULL: AdmitConstraint
ADMIT_CONSTRAINT_IN_FLIGHT_LIMIT: AdmitConstraint
ADMIT_CONSTRAINT_HYPER_CAP: AdmitConstraint
ADMIT_CONSTRAINT_ADMISSION_CAP: AdmitConstraint
ENFORCER_ACTION_KIND_UNSPECIFIED: EnforcerActionKind
ENFORCER_ACTION_KIND_CLEAR_AUX_CACHES: EnforcerActionKind
ENFORCER_ACTION_KIND_PRESSURE_RECLAIM: EnforcerActionKind
ENFORCER_ACTION_KIND_IDLE_RECLAIM: EnforcerActionKind
ENFORCER_ACTION_KIND_SHRINK_SESSIONS: EnforcerActionKind
ENFORCER_ACTION_KIND_EXPIRE_SESSIONS: EnforcerActionKind
ENFORCER_ACTION_KIND_EVICT_MODEL: EnforcerActionKind
ENFORCER_ACTION_KIND_ABORT_REQUESTS: EnforcerActionKind
ENFORCER_ACTION_KIND_MARK_PENDING_UNLOAD: EnforcerActionKind
ENFORCER_ACTION_KIND_ABORT_LOAD: EnforcerActionKind
ENFORCER_ACTION_KIND_PREFILL_ABORT: EnforcerActionKind
ENFORCER_ACTION_KIND_REFUSE_ADMISSION: EnforcerActionKind
ENFORCER_ACTION_KIND_REFUSE_LOAD: EnforcerActionKind
ENFORCER_ACTION_KIND_PAUSE_ADMISSION: EnforcerActionKind
ENFORCER_ACTION_KIND_RESUME_ADMISSION: EnforcerActionKind
ENFORCER_ACTION_KIND_STORE_CACHE_CAP: EnforcerActionKind
ENFORCER_ACTION_KIND_BATCH_CAP: EnforcerActionKind
MODEL_STATE_UNSPECIFIED: ModelState
MODEL_STATE_LOADING: ModelState
MODEL_STATE_READY: ModelState
MODEL_STATE_UNLOADING: ModelState
MODEL_STATE_UNLOADED: ModelState
SESSION_TIER_UNSPECIFIED: SessionTier
SESSION_TIER_RAM: SessionTier
SESSION_TIER_DISK: SessionTier

class AdmitRequest(_message.Message):
    __slots__ = ("request", "reserve", "reservation_ttl", "client_request_id", "owner")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    RESERVE_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_TTL_FIELD_NUMBER: _ClassVar[int]
    CLIENT_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    request: _inference_pb2.GenerateRequest
    reserve: bool
    reservation_ttl: _duration_pb2.Duration
    client_request_id: str
    owner: str
    def __init__(self, request: _Optional[_Union[_inference_pb2.GenerateRequest, _Mapping]] = ..., reserve: _Optional[bool] = ..., reservation_ttl: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., client_request_id: _Optional[str] = ..., owner: _Optional[str] = ...) -> None: ...

class AdmitResponse(_message.Message):
    __slots__ = ("verdict", "projected_bytes", "pressure_level", "reusable_prefix_tokens", "shed_entries", "shed_bytes", "retry_after", "ticket", "reason", "binding_constraint", "ticket_expire_time", "reservation_ttl", "usage_bytes", "request_bytes", "reserved_bytes", "admission_limit_bytes", "admission_headroom_bytes", "error_reason")
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    PROJECTED_BYTES_FIELD_NUMBER: _ClassVar[int]
    PRESSURE_LEVEL_FIELD_NUMBER: _ClassVar[int]
    REUSABLE_PREFIX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SHED_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    SHED_BYTES_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    BINDING_CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    TICKET_EXPIRE_TIME_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_TTL_FIELD_NUMBER: _ClassVar[int]
    USAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    REQUEST_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESERVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    ADMISSION_LIMIT_BYTES_FIELD_NUMBER: _ClassVar[int]
    ADMISSION_HEADROOM_BYTES_FIELD_NUMBER: _ClassVar[int]
    ERROR_REASON_FIELD_NUMBER: _ClassVar[int]
    verdict: AdmitVerdict
    projected_bytes: int
    pressure_level: _types_pb2.PressureLevel
    reusable_prefix_tokens: int
    shed_entries: int
    shed_bytes: int
    retry_after: _duration_pb2.Duration
    ticket: str
    reason: str
    binding_constraint: AdmitConstraint
    ticket_expire_time: _timestamp_pb2.Timestamp
    reservation_ttl: _duration_pb2.Duration
    usage_bytes: int
    request_bytes: int
    reserved_bytes: int
    admission_limit_bytes: int
    admission_headroom_bytes: int
    error_reason: str
    def __init__(self, verdict: _Optional[_Union[AdmitVerdict, str]] = ..., projected_bytes: _Optional[int] = ..., pressure_level: _Optional[_Union[_types_pb2.PressureLevel, str]] = ..., reusable_prefix_tokens: _Optional[int] = ..., shed_entries: _Optional[int] = ..., shed_bytes: _Optional[int] = ..., retry_after: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., ticket: _Optional[str] = ..., reason: _Optional[str] = ..., binding_constraint: _Optional[_Union[AdmitConstraint, str]] = ..., ticket_expire_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., reservation_ttl: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., usage_bytes: _Optional[int] = ..., request_bytes: _Optional[int] = ..., reserved_bytes: _Optional[int] = ..., admission_limit_bytes: _Optional[int] = ..., admission_headroom_bytes: _Optional[int] = ..., error_reason: _Optional[str] = ...) -> None: ...

class PinRequest(_message.Message):
    __slots__ = ("model_id", "session_id", "owner", "ttl", "client_request_id")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    TTL_FIELD_NUMBER: _ClassVar[int]
    CLIENT_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    session_id: str
    owner: str
    ttl: _duration_pb2.Duration
    client_request_id: str
    def __init__(self, model_id: _Optional[str] = ..., session_id: _Optional[str] = ..., owner: _Optional[str] = ..., ttl: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., client_request_id: _Optional[str] = ...) -> None: ...

class PinResponse(_message.Message):
    __slots__ = ("lease",)
    LEASE_FIELD_NUMBER: _ClassVar[int]
    lease: Lease
    def __init__(self, lease: _Optional[_Union[Lease, _Mapping]] = ...) -> None: ...

class Lease(_message.Message):
    __slots__ = ("lease_id", "model_id", "session_id", "owner", "expire_time", "client_request_id")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    EXPIRE_TIME_FIELD_NUMBER: _ClassVar[int]
    CLIENT_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    model_id: str
    session_id: str
    owner: str
    expire_time: _timestamp_pb2.Timestamp
    client_request_id: str
    def __init__(self, lease_id: _Optional[str] = ..., model_id: _Optional[str] = ..., session_id: _Optional[str] = ..., owner: _Optional[str] = ..., expire_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., client_request_id: _Optional[str] = ...) -> None: ...

class UnpinRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class UnpinResponse(_message.Message):
    __slots__ = ("lease",)
    LEASE_FIELD_NUMBER: _ClassVar[int]
    lease: Lease
    def __init__(self, lease: _Optional[_Union[Lease, _Mapping]] = ...) -> None: ...

class WatchPressureRequest(_message.Message):
    __slots__ = ("include_samples", "include_actions", "resume_after_sequence", "resume_instance")
    INCLUDE_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_ACTIONS_FIELD_NUMBER: _ClassVar[int]
    RESUME_AFTER_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    RESUME_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    include_samples: bool
    include_actions: bool
    resume_after_sequence: int
    resume_instance: str
    def __init__(self, include_samples: _Optional[bool] = ..., include_actions: _Optional[bool] = ..., resume_after_sequence: _Optional[int] = ..., resume_instance: _Optional[str] = ...) -> None: ...

class PressureSnapshot(_message.Message):
    __slots__ = ("level", "readings", "limits", "admission", "replay_incomplete")
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    READINGS_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    ADMISSION_FIELD_NUMBER: _ClassVar[int]
    REPLAY_INCOMPLETE_FIELD_NUMBER: _ClassVar[int]
    level: _types_pb2.PressureLevel
    readings: _types_pb2.MemoryReadings
    limits: _types_pb2.MemoryLimits
    admission: _types_pb2.AdmissionState
    replay_incomplete: bool
    def __init__(self, level: _Optional[_Union[_types_pb2.PressureLevel, str]] = ..., readings: _Optional[_Union[_types_pb2.MemoryReadings, _Mapping]] = ..., limits: _Optional[_Union[_types_pb2.MemoryLimits, _Mapping]] = ..., admission: _Optional[_Union[_types_pb2.AdmissionState, _Mapping]] = ..., replay_incomplete: _Optional[bool] = ...) -> None: ...

class PressureTransition(_message.Message):
    __slots__ = ("from_level", "to_level", "readings", "limits", "reason")
    FROM_LEVEL_FIELD_NUMBER: _ClassVar[int]
    TO_LEVEL_FIELD_NUMBER: _ClassVar[int]
    READINGS_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    from_level: _types_pb2.PressureLevel
    to_level: _types_pb2.PressureLevel
    readings: _types_pb2.MemoryReadings
    limits: _types_pb2.MemoryLimits
    reason: str
    def __init__(self, from_level: _Optional[_Union[_types_pb2.PressureLevel, str]] = ..., to_level: _Optional[_Union[_types_pb2.PressureLevel, str]] = ..., readings: _Optional[_Union[_types_pb2.MemoryReadings, _Mapping]] = ..., limits: _Optional[_Union[_types_pb2.MemoryLimits, _Mapping]] = ..., reason: _Optional[str] = ...) -> None: ...

class PressureSample(_message.Message):
    __slots__ = ("level", "readings", "limits", "admission")
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    READINGS_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    ADMISSION_FIELD_NUMBER: _ClassVar[int]
    level: _types_pb2.PressureLevel
    readings: _types_pb2.MemoryReadings
    limits: _types_pb2.MemoryLimits
    admission: _types_pb2.AdmissionState
    def __init__(self, level: _Optional[_Union[_types_pb2.PressureLevel, str]] = ..., readings: _Optional[_Union[_types_pb2.MemoryReadings, _Mapping]] = ..., limits: _Optional[_Union[_types_pb2.MemoryLimits, _Mapping]] = ..., admission: _Optional[_Union[_types_pb2.AdmissionState, _Mapping]] = ...) -> None: ...

class EnforcerAction(_message.Message):
    __slots__ = ("request_ids", "bytes_freed", "entries_evicted", "reason", "level", "kind", "model_id")
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FREED_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_EVICTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    bytes_freed: int
    entries_evicted: int
    reason: str
    level: _types_pb2.PressureLevel
    kind: EnforcerActionKind
    model_id: str
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ..., bytes_freed: _Optional[int] = ..., entries_evicted: _Optional[int] = ..., reason: _Optional[str] = ..., level: _Optional[_Union[_types_pb2.PressureLevel, str]] = ..., kind: _Optional[_Union[EnforcerActionKind, str]] = ..., model_id: _Optional[str] = ...) -> None: ...

class WatchPressureResponse(_message.Message):
    __slots__ = ("sequence", "snapshot", "transition", "sample", "action", "event_time", "replayed", "instance")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    TRANSITION_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    EVENT_TIME_FIELD_NUMBER: _ClassVar[int]
    REPLAYED_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    snapshot: PressureSnapshot
    transition: PressureTransition
    sample: PressureSample
    action: EnforcerAction
    event_time: _timestamp_pb2.Timestamp
    replayed: bool
    instance: str
    def __init__(self, sequence: _Optional[int] = ..., snapshot: _Optional[_Union[PressureSnapshot, _Mapping]] = ..., transition: _Optional[_Union[PressureTransition, _Mapping]] = ..., sample: _Optional[_Union[PressureSample, _Mapping]] = ..., action: _Optional[_Union[EnforcerAction, _Mapping]] = ..., event_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., replayed: _Optional[bool] = ..., instance: _Optional[str] = ...) -> None: ...

class GetMemoryStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetMemoryStatusResponse(_message.Message):
    __slots__ = ("level", "readings", "limits", "models", "leases", "enforcer_enabled", "poll_interval", "admission", "blas", "session_disk")
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    READINGS_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    ENFORCER_ENABLED_FIELD_NUMBER: _ClassVar[int]
    POLL_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    ADMISSION_FIELD_NUMBER: _ClassVar[int]
    BLAS_FIELD_NUMBER: _ClassVar[int]
    SESSION_DISK_FIELD_NUMBER: _ClassVar[int]
    level: _types_pb2.PressureLevel
    readings: _types_pb2.MemoryReadings
    limits: _types_pb2.MemoryLimits
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    leases: _containers.RepeatedCompositeFieldContainer[Lease]
    enforcer_enabled: bool
    poll_interval: _duration_pb2.Duration
    admission: _types_pb2.AdmissionState
    blas: BlasInfo
    session_disk: SessionDiskTier
    def __init__(self, level: _Optional[_Union[_types_pb2.PressureLevel, str]] = ..., readings: _Optional[_Union[_types_pb2.MemoryReadings, _Mapping]] = ..., limits: _Optional[_Union[_types_pb2.MemoryLimits, _Mapping]] = ..., models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ..., leases: _Optional[_Iterable[_Union[Lease, _Mapping]]] = ..., enforcer_enabled: _Optional[bool] = ..., poll_interval: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., admission: _Optional[_Union[_types_pb2.AdmissionState, _Mapping]] = ..., blas: _Optional[_Union[BlasInfo, _Mapping]] = ..., session_disk: _Optional[_Union[SessionDiskTier, _Mapping]] = ...) -> None: ...

class SessionDiskTier(_message.Message):
    __slots__ = ("directory", "budget_bytes", "bytes", "entries", "pending_writes", "pending_bytes", "writes", "written_bytes", "written_last_hour_bytes", "write_budget_bytes_per_hour", "restores", "restore_failures", "hits_ram", "hits_disk", "misses", "drops", "collected", "free_disk_bytes", "kv_bits")
    class DropsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class CollectedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    PENDING_WRITES_FIELD_NUMBER: _ClassVar[int]
    PENDING_BYTES_FIELD_NUMBER: _ClassVar[int]
    WRITES_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_BYTES_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_LAST_HOUR_BYTES_FIELD_NUMBER: _ClassVar[int]
    WRITE_BUDGET_BYTES_PER_HOUR_FIELD_NUMBER: _ClassVar[int]
    RESTORES_FIELD_NUMBER: _ClassVar[int]
    RESTORE_FAILURES_FIELD_NUMBER: _ClassVar[int]
    HITS_RAM_FIELD_NUMBER: _ClassVar[int]
    HITS_DISK_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    DROPS_FIELD_NUMBER: _ClassVar[int]
    COLLECTED_FIELD_NUMBER: _ClassVar[int]
    FREE_DISK_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_BITS_FIELD_NUMBER: _ClassVar[int]
    directory: str
    budget_bytes: int
    bytes: int
    entries: int
    pending_writes: int
    pending_bytes: int
    writes: int
    written_bytes: int
    written_last_hour_bytes: int
    write_budget_bytes_per_hour: int
    restores: int
    restore_failures: int
    hits_ram: int
    hits_disk: int
    misses: int
    drops: _containers.ScalarMap[str, int]
    collected: _containers.ScalarMap[str, int]
    free_disk_bytes: int
    kv_bits: int
    def __init__(self, directory: _Optional[str] = ..., budget_bytes: _Optional[int] = ..., bytes: _Optional[int] = ..., entries: _Optional[int] = ..., pending_writes: _Optional[int] = ..., pending_bytes: _Optional[int] = ..., writes: _Optional[int] = ..., written_bytes: _Optional[int] = ..., written_last_hour_bytes: _Optional[int] = ..., write_budget_bytes_per_hour: _Optional[int] = ..., restores: _Optional[int] = ..., restore_failures: _Optional[int] = ..., hits_ram: _Optional[int] = ..., hits_disk: _Optional[int] = ..., misses: _Optional[int] = ..., drops: _Optional[_Mapping[str, int]] = ..., collected: _Optional[_Mapping[str, int]] = ..., free_disk_bytes: _Optional[int] = ..., kv_bits: _Optional[int] = ...) -> None: ...

class BlasInfo(_message.Message):
    __slots__ = ("name", "version", "description", "threads", "optimized", "reason")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    THREADS_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: str
    description: str
    threads: int
    optimized: bool
    reason: str
    def __init__(self, name: _Optional[str] = ..., version: _Optional[str] = ..., description: _Optional[str] = ..., threads: _Optional[int] = ..., optimized: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("source", "state", "measured_bytes", "active_requests", "waiting_requests", "pinned", "context_length", "kv_bytes_per_token", "is_default", "batch_cap", "pending_unload", "store_cache_cap", "model_id", "last_used_time", "load_time", "keep_alive", "expire_time")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    MEASURED_BYTES_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    IS_DEFAULT_FIELD_NUMBER: _ClassVar[int]
    BATCH_CAP_FIELD_NUMBER: _ClassVar[int]
    PENDING_UNLOAD_FIELD_NUMBER: _ClassVar[int]
    STORE_CACHE_CAP_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    LAST_USED_TIME_FIELD_NUMBER: _ClassVar[int]
    LOAD_TIME_FIELD_NUMBER: _ClassVar[int]
    KEEP_ALIVE_FIELD_NUMBER: _ClassVar[int]
    EXPIRE_TIME_FIELD_NUMBER: _ClassVar[int]
    source: str
    state: ModelState
    measured_bytes: int
    active_requests: int
    waiting_requests: int
    pinned: bool
    context_length: int
    kv_bytes_per_token: int
    is_default: bool
    batch_cap: int
    pending_unload: str
    store_cache_cap: int
    model_id: str
    last_used_time: _timestamp_pb2.Timestamp
    load_time: _timestamp_pb2.Timestamp
    keep_alive: _duration_pb2.Duration
    expire_time: _timestamp_pb2.Timestamp
    def __init__(self, source: _Optional[str] = ..., state: _Optional[_Union[ModelState, str]] = ..., measured_bytes: _Optional[int] = ..., active_requests: _Optional[int] = ..., waiting_requests: _Optional[int] = ..., pinned: _Optional[bool] = ..., context_length: _Optional[int] = ..., kv_bytes_per_token: _Optional[int] = ..., is_default: _Optional[bool] = ..., batch_cap: _Optional[int] = ..., pending_unload: _Optional[str] = ..., store_cache_cap: _Optional[int] = ..., model_id: _Optional[str] = ..., last_used_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., load_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., keep_alive: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., expire_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ("page_size", "page_token")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    page_token: str
    def __init__(self, page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models", "next_page_token")
    MODELS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    next_page_token: str
    def __init__(self, models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class LoadModelRequest(_message.Message):
    __slots__ = ("source", "model_id", "keep_alive")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    KEEP_ALIVE_FIELD_NUMBER: _ClassVar[int]
    source: str
    model_id: str
    keep_alive: _duration_pb2.Duration
    def __init__(self, source: _Optional[str] = ..., model_id: _Optional[str] = ..., keep_alive: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class LoadModelResponse(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: ModelInfo
    def __init__(self, model: _Optional[_Union[ModelInfo, _Mapping]] = ...) -> None: ...

class UnloadModelRequest(_message.Message):
    __slots__ = ("force", "model_id")
    FORCE_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    force: bool
    model_id: str
    def __init__(self, force: _Optional[bool] = ..., model_id: _Optional[str] = ...) -> None: ...

class UnloadModelResponse(_message.Message):
    __slots__ = ("freed_bytes", "aborted_requests", "released_leases")
    FREED_BYTES_FIELD_NUMBER: _ClassVar[int]
    ABORTED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    RELEASED_LEASES_FIELD_NUMBER: _ClassVar[int]
    freed_bytes: int
    aborted_requests: int
    released_leases: int
    def __init__(self, freed_bytes: _Optional[int] = ..., aborted_requests: _Optional[int] = ..., released_leases: _Optional[int] = ...) -> None: ...

class SessionEntry(_message.Message):
    __slots__ = ("prefix_tokens", "bytes", "terminal", "hits", "model_id", "last_access_time", "tier")
    PREFIX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    TERMINAL_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    LAST_ACCESS_TIME_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    prefix_tokens: int
    bytes: int
    terminal: bool
    hits: int
    model_id: str
    last_access_time: _timestamp_pb2.Timestamp
    tier: SessionTier
    def __init__(self, prefix_tokens: _Optional[int] = ..., bytes: _Optional[int] = ..., terminal: _Optional[bool] = ..., hits: _Optional[int] = ..., model_id: _Optional[str] = ..., last_access_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., tier: _Optional[_Union[SessionTier, str]] = ...) -> None: ...

class SessionInfo(_message.Message):
    __slots__ = ("session_id", "entries", "bytes", "active", "pinned")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    entries: _containers.RepeatedCompositeFieldContainer[SessionEntry]
    bytes: int
    active: bool
    pinned: bool
    def __init__(self, session_id: _Optional[str] = ..., entries: _Optional[_Iterable[_Union[SessionEntry, _Mapping]]] = ..., bytes: _Optional[int] = ..., active: _Optional[bool] = ..., pinned: _Optional[bool] = ...) -> None: ...

class ListSessionsRequest(_message.Message):
    __slots__ = ("model_id", "page_size", "page_token")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    page_size: int
    page_token: str
    def __init__(self, model_id: _Optional[str] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListSessionsResponse(_message.Message):
    __slots__ = ("sessions", "total_bytes", "next_page_token", "session_disk")
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SESSION_DISK_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedCompositeFieldContainer[SessionInfo]
    total_bytes: int
    next_page_token: str
    session_disk: SessionDiskTier
    def __init__(self, sessions: _Optional[_Iterable[_Union[SessionInfo, _Mapping]]] = ..., total_bytes: _Optional[int] = ..., next_page_token: _Optional[str] = ..., session_disk: _Optional[_Union[SessionDiskTier, _Mapping]] = ...) -> None: ...

class DropSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class DropSessionResponse(_message.Message):
    __slots__ = ("entries_dropped", "bytes_freed")
    ENTRIES_DROPPED_FIELD_NUMBER: _ClassVar[int]
    BYTES_FREED_FIELD_NUMBER: _ClassVar[int]
    entries_dropped: int
    bytes_freed: int
    def __init__(self, entries_dropped: _Optional[int] = ..., bytes_freed: _Optional[int] = ...) -> None: ...
