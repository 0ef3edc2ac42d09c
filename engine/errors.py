"""Domain errors and the one table of error reasons.

One class per gRPC code; `service.status` maps each to a `google.rpc.Status` with
`google.rpc.ErrorInfo` (domain `DOMAIN`, the error's `reason`, its `metadata`),
`RetryInfo` when `retry_after_s` is set, `ResourceInfo` when `resource_type` is
set, and `BadRequest` (every violation) for `InvalidArgument` / `OutOfRange`.
docs/errors.md documents every reason below; `REASONS` says which class carries
each one. Nothing here knows gRPC.

Messages are for people and must stand alone: no tracebacks, exception reprs,
library internals or server file-system paths (a client's own input, such as a
`source` it sent, may be quoted).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import ClassVar

DOMAIN = "plimsoll.dev"  # google.rpc.ErrorInfo.domain of every error

# -- reasons (google.rpc.ErrorInfo.reason) ---------------------------------------------
# INVALID_ARGUMENT / OUT_OF_RANGE
INVALID_FIELD = "INVALID_FIELD"  # a field is malformed
FIELD_OUT_OF_RANGE = "FIELD_OUT_OF_RANGE"  # a field is well-formed but beyond a limit
MALFORMED_REQUEST = "MALFORMED_REQUEST"  # the bytes do not parse as the request message
# NOT_FOUND (with ResourceInfo)
MODEL_NOT_FOUND = "MODEL_NOT_FOUND"
SESSION_NOT_FOUND = "SESSION_NOT_FOUND"
LEASE_NOT_FOUND = "LEASE_NOT_FOUND"
TICKET_NOT_FOUND = "TICKET_NOT_FOUND"
SOURCE_NOT_FOUND = "SOURCE_NOT_FOUND"  # LoadModel: no such folder or repository
# ALREADY_EXISTS
MODEL_ID_IN_USE = "MODEL_ID_IN_USE"
# FAILED_PRECONDITION
MODEL_NOT_LOADED = "MODEL_NOT_LOADED"  # known, unloaded and not loading
MODEL_PINNED = "MODEL_PINNED"
MODEL_BUSY = "MODEL_BUSY"
TICKET_MISMATCH = "TICKET_MISMATCH"
LOAD_FAILED = "LOAD_FAILED"  # the source is not a loadable model
# UNAVAILABLE (with RetryInfo)
MODEL_LOADING = "MODEL_LOADING"
MODEL_UNLOADING = "MODEL_UNLOADING"  # being unloaded, or marked to unload once idle
DRAINING = "DRAINING"
MEMORY_NOT_MEASURED = "MEMORY_NOT_MEASURED"
SOURCE_UNAVAILABLE = "SOURCE_UNAVAILABLE"  # the hub cannot be reached, nothing cached
# RESOURCE_EXHAUSTED (shed before prefill, refused loads; with RetryInfo)
MEMORY_PRESSURE = "MEMORY_PRESSURE"
RESERVATIONS_HELD = "RESERVATIONS_HELD"
PREFILL_EXCEEDS_CEILING = "PREFILL_EXCEEDS_CEILING"
QUEUE_FULL = "QUEUE_FULL"
IN_FLIGHT_LIMIT = "IN_FLIGHT_LIMIT"
ADMISSION_TIMEOUT = "ADMISSION_TIMEOUT"
LOAD_EXCEEDS_SOFT = "LOAD_EXCEEDS_SOFT"
MAX_LOADED_MODELS = "MAX_LOADED_MODELS"
MAX_MODEL_MEMORY = "MAX_MODEL_MEMORY"
SUBSCRIBER_OVERFLOW = "SUBSCRIBER_OVERFLOW"
LEASE_LIMIT = "LEASE_LIMIT"  # an owner holds --max-leases-per-owner leases
RESERVATION_LIMIT = "RESERVATION_LIMIT"  # an owner holds --max-reservations-per-owner tickets
WATCHER_LIMIT = "WATCHER_LIMIT"  # --max-watchers WatchPressure streams are open
# ABORTED (with RetryInfo)
ENFORCER_ABORT = "ENFORCER_ABORT"
PREFILL_ABORT = "PREFILL_ABORT"
MODEL_UNLOADED = "MODEL_UNLOADED"  # a forced unload ended the request
LOAD_ABORTED = "LOAD_ABORTED"  # the enforcer aborted a load in progress
CLIENT_STALLED = "CLIENT_STALLED"  # the client read nothing for --stream-stall-timeout
# INTERNAL
ENGINE_ERROR = "ENGINE_ERROR"
# UNAUTHENTICATED (no credential, or not one this server knows; service/auth.py)
INVALID_CREDENTIALS = "INVALID_CREDENTIALS"
# PERMISSION_DENIED
SCOPE_DENIED = "SCOPE_DENIED"  # the credential lacks the method's scope
SOURCE_OUTSIDE_ROOTS = "SOURCE_OUTSIDE_ROOTS"  # LoadModel: a path outside --model-root
HUB_DISABLED = "HUB_DISABLED"  # LoadModel: a repository id with --no-hub

# What a NotFound names -> its reason (a call site may give only the resource type).
_NOT_FOUND_REASONS = {
    "model": MODEL_NOT_FOUND,
    "session": SESSION_NOT_FOUND,
    "lease": LEASE_NOT_FOUND,
    "ticket": TICKET_NOT_FOUND,
    "source": SOURCE_NOT_FOUND,
}
# Older call sites named the request field; the resource is what it names.
_RESOURCE_ALIASES = {"model_id": "model", "session_id": "session", "lease_id": "lease",
                     "admission_ticket": "ticket"}


class PlimsollError(Exception):
    """Base of every error a client may see; `message` is the one line it reads.

    `reason`: the ErrorInfo reason (one of the constants above); `metadata`: the
    ErrorInfo metadata (figures, ids); `retry_after_s`: RetryInfo's delay, None
    for no RetryInfo; `resource_type` / `resource_name`: ResourceInfo, when set.
    """

    default_reason: ClassVar[str] = ENGINE_ERROR
    default_retry_after_s: ClassVar[float | None] = None

    def __init__(self, message: str, *, reason: str = "", retry_after_s: float | None = None,
                 metadata: Mapping[str, object] | None = None, resource_type: str = "",
                 resource_name: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.reason = reason or self.default_reason
        self.retry_after_s = (self.default_retry_after_s if retry_after_s is None
                              else retry_after_s)
        self.metadata = {str(k): str(v) for k, v in (metadata or {}).items()}
        self.resource_type = resource_type
        self.resource_name = resource_name

    def __str__(self) -> str:
        return self.message

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.reason}: {self.message!r})"


# -- INVALID_ARGUMENT / OUT_OF_RANGE: every violation, by field path --------------------
@dataclass(frozen=True)
class FieldViolation:
    """One bad field: its path ("sampling.temperature", "stop[2]",
    "chat.messages[0].role") and a sentence that starts with that path."""

    field: str
    description: str
    out_of_range: bool = False  # beyond a limit (OUT_OF_RANGE), not malformed

    @property
    def reason(self) -> str:
        return FIELD_OUT_OF_RANGE if self.out_of_range else INVALID_FIELD

    def under(self, prefix: str) -> FieldViolation:
        if not prefix:
            return self
        field = f"{prefix}.{self.field}" if self.field else prefix
        description = self.description
        if self.field and description.startswith(self.field):
            description = prefix + "." + description
        return replace(self, field=field, description=description)


def _summary(violations: tuple[FieldViolation, ...]) -> str:
    if len(violations) == 1:
        return violations[0].description
    return (f"{len(violations)} fields are invalid: "
            + "; ".join(v.description for v in violations))


class BadRequestError(PlimsollError):
    """A request with one or more bad fields; see `InvalidArgument` and `OutOfRange`."""

    out_of_range: ClassVar[bool] = False

    def __init__(self, message: str = "", field_name: str = "", *,
                 violations: Iterable[FieldViolation] = (), reason: str = "",
                 metadata: Mapping[str, object] | None = None) -> None:
        found = tuple(violations)
        if not found:
            found = (FieldViolation(field_name, message, self.out_of_range),)
        super().__init__(message or _summary(found), reason=reason, metadata=metadata)
        self.violations = found

    @property
    def field_name(self) -> str:
        """The first violation's path (for callers that name one field)."""
        return self.violations[0].field


class InvalidArgument(BadRequestError):
    """A request field is malformed (INVALID_ARGUMENT, INVALID_FIELD)."""

    default_reason = INVALID_FIELD


class OutOfRange(BadRequestError):
    """A request field is well-formed but beyond a limit (OUT_OF_RANGE, FIELD_OUT_OF_RANGE)."""

    default_reason = FIELD_OUT_OF_RANGE
    out_of_range = True


def check_owner_quota(owner: str, held: int, limit: int, *, what: str, flag: str,
                      reason: str, remedy: str) -> None:
    """RESOURCE_EXHAUSTED (RetryInfo 5 s) once `owner` holds `limit` of `what`: the one
    shape of every per-owner limit (leases, reservations)."""
    if held >= limit:
        raise ResourceExhausted(
            f"owner '{owner}' holds {held} {what}; the limit is {limit} per owner ({flag}): "
            f"{remedy}", reason=reason, retry_after_s=5.0,
            metadata={"owner": owner, "held": str(held), "limit": str(limit)})


def bad_request(violations: Iterable[FieldViolation]) -> BadRequestError:
    """One error for all of `violations`: INVALID_ARGUMENT when any field is malformed,
    else OUT_OF_RANGE; the BadRequest detail lists every one either way."""
    found = tuple(violations)
    cls = OutOfRange if all(v.out_of_range for v in found) else InvalidArgument
    return cls(_summary(found), violations=found)


def under_field(err: PlimsollError, prefix: str) -> PlimsollError:
    """`err` with every violation's path (and the message) under `prefix`:
    ControlService.Admit judges a GenerateRequest in its `request` field, so
    `under_field(err, "request")` turns "max_tokens" into "request.max_tokens".
    Errors that name no field come back as they are."""
    if not isinstance(err, BadRequestError) or not prefix:
        return err
    moved = tuple(v.under(prefix) for v in err.violations)
    out = type(err)(_summary(moved), violations=moved, reason=err.reason,
                    metadata=err.metadata)
    out.__cause__ = err.__cause__
    return out


class Violations:
    """Collects every bad field of a request, then raises one error for all of them.

        v = Violations()
        v.invalid("sampling.top_p", f"sampling.top_p must be in (0, 1], got {p}")
        with v.collect():        # an InvalidArgument / OutOfRange raised inside joins
            check_something()
        v.raise_if_any()
    """

    def __init__(self) -> None:
        self._found: list[FieldViolation] = []

    def invalid(self, field: str, description: str) -> None:
        """A malformed field (INVALID_FIELD)."""
        self._found.append(FieldViolation(field, description))

    def out_of_range(self, field: str, description: str) -> None:
        """A well-formed field beyond a limit (FIELD_OUT_OF_RANGE)."""
        self._found.append(FieldViolation(field, description, out_of_range=True))

    def extend(self, err: BadRequestError) -> None:
        self._found.extend(err.violations)

    @contextmanager
    def collect(self) -> Iterator[None]:
        """Adds the violations of an InvalidArgument / OutOfRange raised in the block."""
        try:
            yield
        except BadRequestError as err:
            self.extend(err)

    def __bool__(self) -> bool:
        return bool(self._found)

    def __len__(self) -> int:
        return len(self._found)

    def __iter__(self) -> Iterator[FieldViolation]:
        return iter(self._found)

    def error(self) -> BadRequestError | None:
        return bad_request(self._found) if self._found else None

    def raise_if_any(self) -> None:
        err = self.error()
        if err is not None:
            raise err


# -- the other codes ---------------------------------------------------------------------
class NotFound(PlimsollError):
    """An unknown model, session, lease, ticket or source (NOT_FOUND, with ResourceInfo).

    `resource_type`: "model", "session", "lease", "ticket" or "source"; the reason
    follows from it unless given."""

    def __init__(self, message: str, resource_type: str = "", *, resource_name: str = "",
                 reason: str = "", metadata: Mapping[str, object] | None = None) -> None:
        resource_type = _RESOURCE_ALIASES.get(resource_type, resource_type)
        reason = reason or _NOT_FOUND_REASONS.get(resource_type, "")
        if not resource_type:
            resource_type = next((t for t, r in _NOT_FOUND_REASONS.items() if r == reason),
                                 "resource")
        super().__init__(message, reason=reason or MODEL_NOT_FOUND, metadata=metadata,
                         resource_type=resource_type, resource_name=resource_name)

    @property
    def resource(self) -> str:
        return self.resource_type


class AlreadyExists(PlimsollError):
    """The id asked for is taken (ALREADY_EXISTS, with ResourceInfo)."""

    default_reason = MODEL_ID_IN_USE

    def __init__(self, message: str, *, reason: str = "", resource_type: str = "model",
                 resource_name: str = "", metadata: Mapping[str, object] | None = None
                 ) -> None:
        super().__init__(message, reason=reason, metadata=metadata,
                         resource_type=resource_type, resource_name=resource_name)


class FailedPrecondition(PlimsollError):
    """Not allowed in the current state; retrying as is will not help until the state
    changes (FAILED_PRECONDITION, no RetryInfo)."""

    default_reason = MODEL_NOT_LOADED

    def __init__(self, message: str, reason: str = "", *, resource_type: str = "",
                 resource_name: str = "", metadata: Mapping[str, object] | None = None
                 ) -> None:
        super().__init__(message, reason=reason, metadata=metadata,
                         resource_type=resource_type, resource_name=resource_name)


class Unavailable(PlimsollError):
    """Draining, loading, unloading, not measured yet: retry later or elsewhere
    (UNAVAILABLE, with RetryInfo)."""

    default_reason = MODEL_UNLOADING
    default_retry_after_s = 1.0

    def __init__(self, message: str, retry_after_s: float | None = None, *,
                 reason: str = "", resource_type: str = "", resource_name: str = "",
                 metadata: Mapping[str, object] | None = None) -> None:
        super().__init__(message, reason=reason, retry_after_s=retry_after_s,
                         metadata=metadata, resource_type=resource_type,
                         resource_name=resource_name)


class ResourceExhausted(PlimsollError):
    """Shed for memory, queue or in-flight space, or a refused load
    (RESOURCE_EXHAUSTED, with RetryInfo and the byte figures in metadata)."""

    default_reason = MEMORY_PRESSURE
    default_retry_after_s = 1.0

    def __init__(self, message: str, *, reason: str = "", retry_after_s: float | None = None,
                 metadata: Mapping[str, object] | None = None) -> None:
        super().__init__(message, reason=reason, retry_after_s=retry_after_s,
                         metadata=metadata)


class Aborted(PlimsollError):
    """Ended by the memory enforcer, the prefill guard or a forced unload
    (ABORTED, with RetryInfo)."""

    default_reason = ENFORCER_ABORT
    default_retry_after_s = 1.0

    def __init__(self, message: str, *, reason: str = "", retry_after_s: float | None = None,
                 metadata: Mapping[str, object] | None = None) -> None:
        super().__init__(message, reason=reason, retry_after_s=retry_after_s,
                         metadata=metadata)


class Internal(PlimsollError):
    """The engine failed (INTERNAL, ENGINE_ERROR); the message names no internals."""

    default_reason = ENGINE_ERROR

    def __init__(self, message: str, *, reason: str = "", retry_after_s: float | None = None,
                 metadata: Mapping[str, object] | None = None) -> None:
        super().__init__(message, reason=reason, retry_after_s=retry_after_s,
                         metadata=metadata)


class Unauthenticated(PlimsollError):
    """No credential, or one the server does not know (UNAUTHENTICATED). The message
    says only that; nothing tells a wrong token from a missing one or an unknown one."""

    default_reason = INVALID_CREDENTIALS

    def __init__(self, message: str = "missing or invalid credentials", *,
                 reason: str = "") -> None:
        super().__init__(message, reason=reason)


class PermissionDenied(PlimsollError):
    """The caller is known but may not do this: a scope it lacks, a LoadModel source
    outside the model roots or from the hub when that is off (PERMISSION_DENIED).
    `resource_type` / `resource_name` name the client's own input (the `source`)."""

    default_reason = SCOPE_DENIED

    def __init__(self, message: str, reason: str = "", *, resource_type: str = "",
                 resource_name: str = "", metadata: Mapping[str, object] | None = None
                 ) -> None:
        super().__init__(message, reason=reason, metadata=metadata,
                         resource_type=resource_type, resource_name=resource_name)


# -- the table: every reason and the one class (code) that carries it -------------------
REASONS: dict[str, type[PlimsollError]] = {
    INVALID_FIELD: InvalidArgument,
    MALFORMED_REQUEST: InvalidArgument,
    FIELD_OUT_OF_RANGE: OutOfRange,
    MODEL_NOT_FOUND: NotFound,
    SESSION_NOT_FOUND: NotFound,
    LEASE_NOT_FOUND: NotFound,
    TICKET_NOT_FOUND: NotFound,
    SOURCE_NOT_FOUND: NotFound,
    MODEL_ID_IN_USE: AlreadyExists,
    MODEL_NOT_LOADED: FailedPrecondition,
    MODEL_PINNED: FailedPrecondition,
    MODEL_BUSY: FailedPrecondition,
    TICKET_MISMATCH: FailedPrecondition,
    LOAD_FAILED: FailedPrecondition,
    MODEL_LOADING: Unavailable,
    MODEL_UNLOADING: Unavailable,
    DRAINING: Unavailable,
    MEMORY_NOT_MEASURED: Unavailable,
    SOURCE_UNAVAILABLE: Unavailable,
    MEMORY_PRESSURE: ResourceExhausted,
    RESERVATIONS_HELD: ResourceExhausted,
    PREFILL_EXCEEDS_CEILING: ResourceExhausted,
    QUEUE_FULL: ResourceExhausted,
    IN_FLIGHT_LIMIT: ResourceExhausted,
    ADMISSION_TIMEOUT: ResourceExhausted,
    LOAD_EXCEEDS_SOFT: ResourceExhausted,
    MAX_LOADED_MODELS: ResourceExhausted,
    MAX_MODEL_MEMORY: ResourceExhausted,
    SUBSCRIBER_OVERFLOW: ResourceExhausted,
    LEASE_LIMIT: ResourceExhausted,
    RESERVATION_LIMIT: ResourceExhausted,
    WATCHER_LIMIT: ResourceExhausted,
    ENFORCER_ABORT: Aborted,
    PREFILL_ABORT: Aborted,
    MODEL_UNLOADED: Aborted,
    LOAD_ABORTED: Aborted,
    CLIENT_STALLED: Aborted,
    ENGINE_ERROR: Internal,
    INVALID_CREDENTIALS: Unauthenticated,
    SCOPE_DENIED: PermissionDenied,
    SOURCE_OUTSIDE_ROOTS: PermissionDenied,
    HUB_DISABLED: PermissionDenied,
}
# In BadRequest a mixed request (malformed and out-of-range fields) is INVALID_ARGUMENT /
# INVALID_FIELD; each FieldViolation keeps its own reason.
