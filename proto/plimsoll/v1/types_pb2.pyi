from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class PressureLevel(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PRESSURE_LEVEL_UNSPECIFIED: _ClassVar[PressureLevel]
    PRESSURE_LEVEL_OK: _ClassVar[PressureLevel]
    PRESSURE_LEVEL_SOFT: _ClassVar[PressureLevel]
    PRESSURE_LEVEL_HARD: _ClassVar[PressureLevel]
    PRESSURE_LEVEL_EMERGENCY: _ClassVar[PressureLevel]
PRESSURE_LEVEL_UNSPECIFIED: PressureLevel
PRESSURE_LEVEL_OK: PressureLevel
PRESSURE_LEVEL_SOFT: PressureLevel
PRESSURE_LEVEL_HARD: PressureLevel
PRESSURE_LEVEL_EMERGENCY: PressureLevel

class MemoryReadings(_message.Message):
    __slots__ = ("process_bytes", "mlx_active_bytes", "mlx_pool_bytes", "footprint_bytes", "system_total_bytes", "system_available_bytes", "container_limit_bytes", "container_usage_bytes", "device_limit_bytes", "os_pressure", "sources")
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
    OS_PRESSURE_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    process_bytes: int
    mlx_active_bytes: int
    mlx_pool_bytes: int
    footprint_bytes: int
    system_total_bytes: int
    system_available_bytes: int
    container_limit_bytes: int
    container_usage_bytes: int
    device_limit_bytes: int
    os_pressure: str
    sources: _containers.ScalarMap[str, str]
    def __init__(self, process_bytes: _Optional[int] = ..., mlx_active_bytes: _Optional[int] = ..., mlx_pool_bytes: _Optional[int] = ..., footprint_bytes: _Optional[int] = ..., system_total_bytes: _Optional[int] = ..., system_available_bytes: _Optional[int] = ..., container_limit_bytes: _Optional[int] = ..., container_usage_bytes: _Optional[int] = ..., device_limit_bytes: _Optional[int] = ..., os_pressure: _Optional[str] = ..., sources: _Optional[_Mapping[str, str]] = ...) -> None: ...

class MemoryLimits(_message.Message):
    __slots__ = ("ceiling_bytes", "soft_bytes", "hard_bytes", "abort_cap_bytes", "binding_term", "terms", "tier")
    class TermsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    CEILING_BYTES_FIELD_NUMBER: _ClassVar[int]
    SOFT_BYTES_FIELD_NUMBER: _ClassVar[int]
    HARD_BYTES_FIELD_NUMBER: _ClassVar[int]
    ABORT_CAP_BYTES_FIELD_NUMBER: _ClassVar[int]
    BINDING_TERM_FIELD_NUMBER: _ClassVar[int]
    TERMS_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    ceiling_bytes: int
    soft_bytes: int
    hard_bytes: int
    abort_cap_bytes: int
    binding_term: str
    terms: _containers.ScalarMap[str, int]
    tier: str
    def __init__(self, ceiling_bytes: _Optional[int] = ..., soft_bytes: _Optional[int] = ..., hard_bytes: _Optional[int] = ..., abort_cap_bytes: _Optional[int] = ..., binding_term: _Optional[str] = ..., terms: _Optional[_Mapping[str, int]] = ..., tier: _Optional[str] = ...) -> None: ...
