from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PressureLevel(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PRESSURE_LEVEL_UNSPECIFIED: _ClassVar[PressureLevel]
    PRESSURE_LEVEL_OK: _ClassVar[PressureLevel]
    PRESSURE_LEVEL_SOFT: _ClassVar[PressureLevel]
    PRESSURE_LEVEL_HARD: _ClassVar[PressureLevel]
    PRESSURE_LEVEL_EMERGENCY: _ClassVar[PressureLevel]

class OsPressure(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OS_PRESSURE_UNSPECIFIED: _ClassVar[OsPressure]
    OS_PRESSURE_NORMAL: _ClassVar[OsPressure]
    OS_PRESSURE_WARNING: _ClassVar[OsPressure]
    OS_PRESSURE_CRITICAL: _ClassVar[OsPressure]

class CeilingTerm(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CEILING_TERM_UNSPECIFIED: _ClassVar[CeilingTerm]
    CEILING_TERM_STATIC: _ClassVar[CeilingTerm]
    CEILING_TERM_DYNAMIC: _ClassVar[CeilingTerm]
    CEILING_TERM_CONTAINER: _ClassVar[CeilingTerm]
    CEILING_TERM_DEVICE: _ClassVar[CeilingTerm]
    CEILING_TERM_CUSTOM: _ClassVar[CeilingTerm]
    CEILING_TERM_OPERATOR: _ClassVar[CeilingTerm]

class MemoryGuardTier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MEMORY_GUARD_TIER_UNSPECIFIED: _ClassVar[MemoryGuardTier]
    MEMORY_GUARD_TIER_SAFE: _ClassVar[MemoryGuardTier]
    MEMORY_GUARD_TIER_BALANCED: _ClassVar[MemoryGuardTier]
    MEMORY_GUARD_TIER_AGGRESSIVE: _ClassVar[MemoryGuardTier]
    MEMORY_GUARD_TIER_CUSTOM: _ClassVar[MemoryGuardTier]
PRESSURE_LEVEL_UNSPECIFIED: PressureLevel
PRESSURE_LEVEL_OK: PressureLevel
PRESSURE_LEVEL_SOFT: PressureLevel
PRESSURE_LEVEL_HARD: PressureLevel
PRESSURE_LEVEL_EMERGENCY: PressureLevel
OS_PRESSURE_UNSPECIFIED: OsPressure
OS_PRESSURE_NORMAL: OsPressure
OS_PRESSURE_WARNING: OsPressure
OS_PRESSURE_CRITICAL: OsPressure
CEILING_TERM_UNSPECIFIED: CeilingTerm
CEILING_TERM_STATIC: CeilingTerm
CEILING_TERM_DYNAMIC: CeilingTerm
CEILING_TERM_CONTAINER: CeilingTerm
CEILING_TERM_DEVICE: CeilingTerm
CEILING_TERM_CUSTOM: CeilingTerm
CEILING_TERM_OPERATOR: CeilingTerm
MEMORY_GUARD_TIER_UNSPECIFIED: MemoryGuardTier
MEMORY_GUARD_TIER_SAFE: MemoryGuardTier
MEMORY_GUARD_TIER_BALANCED: MemoryGuardTier
MEMORY_GUARD_TIER_AGGRESSIVE: MemoryGuardTier
MEMORY_GUARD_TIER_CUSTOM: MemoryGuardTier

class MemoryReadings(_message.Message):
    __slots__ = ("process_bytes", "mlx_active_bytes", "mlx_pool_bytes", "footprint_bytes", "system_total_bytes", "system_available_bytes", "container_limit_bytes", "container_usage_bytes", "device_limit_bytes", "sources", "os_pressure")
    class SourcesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    PROCESS_BYTES_FIELD_NUMBER: _ClassVar[int]
    MLX_ACTIVE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MLX_POOL_BYTES_FIELD_NUMBER: _ClassVar[int]
    FOOTPRINT_BYTES_FIELD_NUMBER: _ClassVar[int]
    SYSTEM_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    SYSTEM_AVAILABLE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CONTAINER_LIMIT_BYTES_FIELD_NUMBER: _ClassVar[int]
    CONTAINER_USAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_LIMIT_BYTES_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    OS_PRESSURE_FIELD_NUMBER: _ClassVar[int]
    process_bytes: int
    mlx_active_bytes: int
    mlx_pool_bytes: int
    footprint_bytes: int
    system_total_bytes: int
    system_available_bytes: int
    container_limit_bytes: int
    container_usage_bytes: int
    device_limit_bytes: int
    sources: _containers.ScalarMap[str, str]
    os_pressure: OsPressure
    def __init__(self, process_bytes: _Optional[int] = ..., mlx_active_bytes: _Optional[int] = ..., mlx_pool_bytes: _Optional[int] = ..., footprint_bytes: _Optional[int] = ..., system_total_bytes: _Optional[int] = ..., system_available_bytes: _Optional[int] = ..., container_limit_bytes: _Optional[int] = ..., container_usage_bytes: _Optional[int] = ..., device_limit_bytes: _Optional[int] = ..., sources: _Optional[_Mapping[str, str]] = ..., os_pressure: _Optional[_Union[OsPressure, str]] = ...) -> None: ...

class CeilingTermBytes(_message.Message):
    __slots__ = ("term", "bytes")
    TERM_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    term: CeilingTerm
    bytes: int
    def __init__(self, term: _Optional[_Union[CeilingTerm, str]] = ..., bytes: _Optional[int] = ...) -> None: ...

class MemoryLimits(_message.Message):
    __slots__ = ("ceiling_bytes", "soft_bytes", "hard_bytes", "abort_cap_bytes", "binding_term", "terms", "tier", "admission_limit_bytes", "admission_shed_bytes")
    CEILING_BYTES_FIELD_NUMBER: _ClassVar[int]
    SOFT_BYTES_FIELD_NUMBER: _ClassVar[int]
    HARD_BYTES_FIELD_NUMBER: _ClassVar[int]
    ABORT_CAP_BYTES_FIELD_NUMBER: _ClassVar[int]
    BINDING_TERM_FIELD_NUMBER: _ClassVar[int]
    TERMS_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    ADMISSION_LIMIT_BYTES_FIELD_NUMBER: _ClassVar[int]
    ADMISSION_SHED_BYTES_FIELD_NUMBER: _ClassVar[int]
    ceiling_bytes: int
    soft_bytes: int
    hard_bytes: int
    abort_cap_bytes: int
    binding_term: CeilingTerm
    terms: _containers.RepeatedCompositeFieldContainer[CeilingTermBytes]
    tier: MemoryGuardTier
    admission_limit_bytes: int
    admission_shed_bytes: int
    def __init__(self, ceiling_bytes: _Optional[int] = ..., soft_bytes: _Optional[int] = ..., hard_bytes: _Optional[int] = ..., abort_cap_bytes: _Optional[int] = ..., binding_term: _Optional[_Union[CeilingTerm, str]] = ..., terms: _Optional[_Iterable[_Union[CeilingTermBytes, _Mapping]]] = ..., tier: _Optional[_Union[MemoryGuardTier, str]] = ..., admission_limit_bytes: _Optional[int] = ..., admission_shed_bytes: _Optional[int] = ...) -> None: ...

class AdmissionState(_message.Message):
    __slots__ = ("paused", "reserved_bytes", "reservations", "running", "waiting", "draining", "session_bank_bytes")
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    RESERVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESERVATIONS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    SESSION_BANK_BYTES_FIELD_NUMBER: _ClassVar[int]
    paused: bool
    reserved_bytes: int
    reservations: int
    running: int
    waiting: int
    draining: bool
    session_bank_bytes: int
    def __init__(self, paused: _Optional[bool] = ..., reserved_bytes: _Optional[int] = ..., reservations: _Optional[int] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., draining: _Optional[bool] = ..., session_bank_bytes: _Optional[int] = ...) -> None: ...
