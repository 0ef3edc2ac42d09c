"""Domain errors. The service maps each to a gRPC status (`service.status`)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PlimsollError(Exception):
    """Base of every error a client may see; `message` is the one line it reads."""

    message: str

    def __str__(self) -> str:
        return self.message


@dataclass
class InvalidArgument(PlimsollError):
    """A request field is malformed (INVALID_ARGUMENT)."""

    field_name: str = ""


@dataclass
class OutOfRange(PlimsollError):
    """A request field is well-formed but beyond a limit (OUT_OF_RANGE)."""

    field_name: str = ""


@dataclass
class NotFound(PlimsollError):
    """An unknown model, session or lease (NOT_FOUND)."""

    resource: str = ""


@dataclass
class FailedPrecondition(PlimsollError):
    """The operation is not allowed in the current state (FAILED_PRECONDITION)."""

    reason: str = ""


@dataclass
class Unavailable(PlimsollError):
    """Draining, loading or stopping; retry elsewhere or later (UNAVAILABLE)."""

    retry_after_s: float = 1.0


@dataclass
class ResourceExhausted(PlimsollError):
    """Shed for memory or queue space (RESOURCE_EXHAUSTED with ErrorInfo/RetryInfo)."""

    reason: str = "MEMORY_PRESSURE"
    retry_after_s: float = 1.0
    metadata: dict[str, str] = field(default_factory=dict)


@dataclass
class Aborted(PlimsollError):
    """Ended by the memory enforcer or a forced unload (ABORTED with ErrorInfo/RetryInfo)."""

    reason: str = "MEMORY_PRESSURE"
    retry_after_s: float = 1.0
    metadata: dict[str, str] = field(default_factory=dict)
