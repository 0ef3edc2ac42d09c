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

class ModelState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODEL_STATE_UNSPECIFIED: _ClassVar[ModelState]
    MODEL_STATE_LOADING: _ClassVar[ModelState]
    MODEL_STATE_READY: _ClassVar[ModelState]
    MODEL_STATE_UNLOADING: _ClassVar[ModelState]
    MODEL_STATE_UNLOADED: _ClassVar[ModelState]
ADMIT_VERDICT_UNSPECIFIED: AdmitVerdict
ADMIT_VERDICT_ADMIT: AdmitVerdict
ADMIT_VERDICT_ADMIT_AFTER_SHEDDING: AdmitVerdict
ADMIT_VERDICT_WAIT: AdmitVerdict
ADMIT_VERDICT_REJECT: AdmitVerdict
MODEL_STATE_UNSPECIFIED: ModelState
MODEL_STATE_LOADING: ModelState
MODEL_STATE_READY: ModelState
MODEL_STATE_UNLOADING: ModelState
MODEL_STATE_UNLOADED: ModelState

class AdmitRequest(_message.Message):
    __slots__ = ("request", "reserve", "reservation_ttl")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    RESERVE_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_TTL_FIELD_NUMBER: _ClassVar[int]
    request: _inference_pb2.GenerateRequest
    reserve: bool
    reservation_ttl: _duration_pb2.Duration
    def __init__(self, request: _Optional[_Union[_inference_pb2.GenerateRequest, _Mapping]] = ..., reserve: _Optional[bool] = ..., reservation_ttl: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class AdmitResponse(_message.Message):
    __slots__ = ("verdict", "projected_bytes", "headroom_bytes", "pressure_level", "reusable_prefix_tokens", "shed_entries", "shed_bytes", "retry_after", "ticket", "ticket_expires_at", "binding_constraint", "reason")
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    PROJECTED_BYTES_FIELD_NUMBER: _ClassVar[int]
    HEADROOM_BYTES_FIELD_NUMBER: _ClassVar[int]
    PRESSURE_LEVEL_FIELD_NUMBER: _ClassVar[int]
    REUSABLE_PREFIX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SHED_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    SHED_BYTES_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    TICKET_EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    BINDING_CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    verdict: AdmitVerdict
    projected_bytes: int
    headroom_bytes: int
    pressure_level: _types_pb2.PressureLevel
    reusable_prefix_tokens: int
    shed_entries: int
    shed_bytes: int
    retry_after: _duration_pb2.Duration
    ticket: str
    ticket_expires_at: _timestamp_pb2.Timestamp
    binding_constraint: str
    reason: str
    def __init__(self, verdict: _Optional[_Union[AdmitVerdict, str]] = ..., projected_bytes: _Optional[int] = ..., headroom_bytes: _Optional[int] = ..., pressure_level: _Optional[_Union[_types_pb2.PressureLevel, str]] = ..., reusable_prefix_tokens: _Optional[int] = ..., shed_entries: _Optional[int] = ..., shed_bytes: _Optional[int] = ..., retry_after: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., ticket: _Optional[str] = ..., ticket_expires_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., binding_constraint: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class PinRequest(_message.Message):
    __slots__ = ("model", "session_id", "owner", "ttl")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    TTL_FIELD_NUMBER: _ClassVar[int]
    model: str
    session_id: str
    owner: str
    ttl: _duration_pb2.Duration
    def __init__(self, model: _Optional[str] = ..., session_id: _Optional[str] = ..., owner: _Optional[str] = ..., ttl: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class PinResponse(_message.Message):
    __slots__ = ("lease",)
    LEASE_FIELD_NUMBER: _ClassVar[int]
    lease: Lease
    def __init__(self, lease: _Optional[_Union[Lease, _Mapping]] = ...) -> None: ...

class Lease(_message.Message):
    __slots__ = ("lease_id", "model", "session_id", "owner", "expires_at")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    model: str
    session_id: str
    owner: str
    expires_at: _timestamp_pb2.Timestamp
    def __init__(self, lease_id: _Optional[str] = ..., model: _Optional[str] = ..., session_id: _Optional[str] = ..., owner: _Optional[str] = ..., expires_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

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
    __slots__ = ("include_samples", "include_actions")
    INCLUDE_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_ACTIONS_FIELD_NUMBER: _ClassVar[int]
    include_samples: bool
    include_actions: bool
    def __init__(self, include_samples: _Optional[bool] = ..., include_actions: _Optional[bool] = ...) -> None: ...

class PressureSnapshot(_message.Message):
    __slots__ = ("level", "readings", "limits")
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    READINGS_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    level: _types_pb2.PressureLevel
    readings: _types_pb2.MemoryReadings
    limits: _types_pb2.MemoryLimits
    def __init__(self, level: _Optional[_Union[_types_pb2.PressureLevel, str]] = ..., readings: _Optional[_Union[_types_pb2.MemoryReadings, _Mapping]] = ..., limits: _Optional[_Union[_types_pb2.MemoryLimits, _Mapping]] = ...) -> None: ...

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
    __slots__ = ("level", "readings", "limits")
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    READINGS_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    level: _types_pb2.PressureLevel
    readings: _types_pb2.MemoryReadings
    limits: _types_pb2.MemoryLimits
    def __init__(self, level: _Optional[_Union[_types_pb2.PressureLevel, str]] = ..., readings: _Optional[_Union[_types_pb2.MemoryReadings, _Mapping]] = ..., limits: _Optional[_Union[_types_pb2.MemoryLimits, _Mapping]] = ...) -> None: ...

class EnforcerAction(_message.Message):
    __slots__ = ("kind", "model", "request_ids", "bytes_freed", "entries_evicted", "reason", "level")
    KIND_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FREED_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_EVICTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    kind: str
    model: str
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    bytes_freed: int
    entries_evicted: int
    reason: str
    level: _types_pb2.PressureLevel
    def __init__(self, kind: _Optional[str] = ..., model: _Optional[str] = ..., request_ids: _Optional[_Iterable[str]] = ..., bytes_freed: _Optional[int] = ..., entries_evicted: _Optional[int] = ..., reason: _Optional[str] = ..., level: _Optional[_Union[_types_pb2.PressureLevel, str]] = ...) -> None: ...

class WatchPressureResponse(_message.Message):
    __slots__ = ("sequence", "time", "snapshot", "transition", "sample", "action")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    TRANSITION_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    time: _timestamp_pb2.Timestamp
    snapshot: PressureSnapshot
    transition: PressureTransition
    sample: PressureSample
    action: EnforcerAction
    def __init__(self, sequence: _Optional[int] = ..., time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., snapshot: _Optional[_Union[PressureSnapshot, _Mapping]] = ..., transition: _Optional[_Union[PressureTransition, _Mapping]] = ..., sample: _Optional[_Union[PressureSample, _Mapping]] = ..., action: _Optional[_Union[EnforcerAction, _Mapping]] = ...) -> None: ...

class GetMemoryStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetMemoryStatusResponse(_message.Message):
    __slots__ = ("level", "readings", "limits", "models", "leases", "enforcer_enabled", "poll_interval_seconds", "admission_paused", "session_bank_bytes")
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    READINGS_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    ENFORCER_ENABLED_FIELD_NUMBER: _ClassVar[int]
    POLL_INTERVAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ADMISSION_PAUSED_FIELD_NUMBER: _ClassVar[int]
    SESSION_BANK_BYTES_FIELD_NUMBER: _ClassVar[int]
    level: _types_pb2.PressureLevel
    readings: _types_pb2.MemoryReadings
    limits: _types_pb2.MemoryLimits
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    leases: _containers.RepeatedCompositeFieldContainer[Lease]
    enforcer_enabled: bool
    poll_interval_seconds: float
    admission_paused: bool
    session_bank_bytes: int
    def __init__(self, level: _Optional[_Union[_types_pb2.PressureLevel, str]] = ..., readings: _Optional[_Union[_types_pb2.MemoryReadings, _Mapping]] = ..., limits: _Optional[_Union[_types_pb2.MemoryLimits, _Mapping]] = ..., models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ..., leases: _Optional[_Iterable[_Union[Lease, _Mapping]]] = ..., enforcer_enabled: _Optional[bool] = ..., poll_interval_seconds: _Optional[float] = ..., admission_paused: _Optional[bool] = ..., session_bank_bytes: _Optional[int] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("id", "source", "state", "measured_bytes", "active_requests", "waiting_requests", "pinned", "last_used", "context_length", "kv_bytes_per_token", "is_default", "batch_cap", "pending_unload", "store_cache_cap")
    ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    MEASURED_BYTES_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    LAST_USED_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    IS_DEFAULT_FIELD_NUMBER: _ClassVar[int]
    BATCH_CAP_FIELD_NUMBER: _ClassVar[int]
    PENDING_UNLOAD_FIELD_NUMBER: _ClassVar[int]
    STORE_CACHE_CAP_FIELD_NUMBER: _ClassVar[int]
    id: str
    source: str
    state: ModelState
    measured_bytes: int
    active_requests: int
    waiting_requests: int
    pinned: bool
    last_used: _timestamp_pb2.Timestamp
    context_length: int
    kv_bytes_per_token: int
    is_default: bool
    batch_cap: int
    pending_unload: str
    store_cache_cap: int
    def __init__(self, id: _Optional[str] = ..., source: _Optional[str] = ..., state: _Optional[_Union[ModelState, str]] = ..., measured_bytes: _Optional[int] = ..., active_requests: _Optional[int] = ..., waiting_requests: _Optional[int] = ..., pinned: _Optional[bool] = ..., last_used: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., context_length: _Optional[int] = ..., kv_bytes_per_token: _Optional[int] = ..., is_default: _Optional[bool] = ..., batch_cap: _Optional[int] = ..., pending_unload: _Optional[str] = ..., store_cache_cap: _Optional[int] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ...) -> None: ...

class LoadModelRequest(_message.Message):
    __slots__ = ("source", "id")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    source: str
    id: str
    def __init__(self, source: _Optional[str] = ..., id: _Optional[str] = ...) -> None: ...

class LoadModelResponse(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: ModelInfo
    def __init__(self, model: _Optional[_Union[ModelInfo, _Mapping]] = ...) -> None: ...

class UnloadModelRequest(_message.Message):
    __slots__ = ("id", "force")
    ID_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    id: str
    force: bool
    def __init__(self, id: _Optional[str] = ..., force: _Optional[bool] = ...) -> None: ...

class UnloadModelResponse(_message.Message):
    __slots__ = ("freed_bytes", "aborted_requests")
    FREED_BYTES_FIELD_NUMBER: _ClassVar[int]
    ABORTED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    freed_bytes: int
    aborted_requests: int
    def __init__(self, freed_bytes: _Optional[int] = ..., aborted_requests: _Optional[int] = ...) -> None: ...

class SessionEntry(_message.Message):
    __slots__ = ("model", "prefix_tokens", "bytes", "terminal", "hits", "last_access")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PREFIX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    TERMINAL_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    LAST_ACCESS_FIELD_NUMBER: _ClassVar[int]
    model: str
    prefix_tokens: int
    bytes: int
    terminal: bool
    hits: int
    last_access: _timestamp_pb2.Timestamp
    def __init__(self, model: _Optional[str] = ..., prefix_tokens: _Optional[int] = ..., bytes: _Optional[int] = ..., terminal: _Optional[bool] = ..., hits: _Optional[int] = ..., last_access: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

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
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class ListSessionsResponse(_message.Message):
    __slots__ = ("sessions", "total_bytes")
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedCompositeFieldContainer[SessionInfo]
    total_bytes: int
    def __init__(self, sessions: _Optional[_Iterable[_Union[SessionInfo, _Mapping]]] = ..., total_bytes: _Optional[int] = ...) -> None: ...

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
