"""Domain errors → gRPC statuses with rich details (google.rpc.Status via grpcio-status).

The one mapping: every status the servicers send goes through `to_status`. Each
carries google.rpc.ErrorInfo (domain "plimsoll.dev", the error's reason and
metadata) first, then RetryInfo when the error has a retry delay, ResourceInfo
when it names a resource, and BadRequest with every field violation for
INVALID_ARGUMENT / OUT_OF_RANGE. docs/errors.md is the table.
"""

from __future__ import annotations

import logging

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from engine import errors

log = logging.getLogger(__name__)

DOMAIN = errors.DOMAIN

_CODES: list[tuple[type[errors.PlimsollError], int]] = [
    (errors.InvalidArgument, code_pb2.INVALID_ARGUMENT),
    (errors.OutOfRange, code_pb2.OUT_OF_RANGE),
    (errors.NotFound, code_pb2.NOT_FOUND),
    (errors.AlreadyExists, code_pb2.ALREADY_EXISTS),
    (errors.FailedPrecondition, code_pb2.FAILED_PRECONDITION),
    (errors.Unavailable, code_pb2.UNAVAILABLE),
    (errors.ResourceExhausted, code_pb2.RESOURCE_EXHAUSTED),
    (errors.Aborted, code_pb2.ABORTED),
    (errors.Internal, code_pb2.INTERNAL),
    (errors.Unauthenticated, code_pb2.UNAUTHENTICATED),
    (errors.PermissionDenied, code_pb2.PERMISSION_DENIED),
]

# What a client reads for an exception that is not ours: nothing of its text.
UNEXPECTED_MESSAGE = "the server failed while handling this request; see the server log"


def code_of(err: errors.PlimsollError) -> int:
    """The google.rpc.Code for `err` (INTERNAL for anything unlisted)."""
    return next((c for cls, c in _CODES if isinstance(err, cls)), code_pb2.INTERNAL)


def _pack(message) -> any_pb2.Any:
    detail = any_pb2.Any()
    detail.Pack(message)
    return detail


def _retry(seconds: float) -> any_pb2.Any:
    delay = duration_pb2.Duration()
    delay.FromNanoseconds(int(max(0.0, seconds) * 1e9))
    return _pack(error_details_pb2.RetryInfo(retry_delay=delay))


def details_of(err: errors.PlimsollError) -> list[any_pb2.Any]:
    """ErrorInfo, then RetryInfo, ResourceInfo and BadRequest where they apply."""
    details = [_pack(error_details_pb2.ErrorInfo(
        reason=err.reason, domain=DOMAIN, metadata=err.metadata))]
    if err.retry_after_s is not None:
        details.append(_retry(err.retry_after_s))
    if err.resource_type:
        details.append(_pack(error_details_pb2.ResourceInfo(
            resource_type=err.resource_type, resource_name=err.resource_name,
            description=err.message)))
    if isinstance(err, errors.BadRequestError):
        details.append(_pack(error_details_pb2.BadRequest(field_violations=[
            error_details_pb2.BadRequest.FieldViolation(
                field=v.field, description=v.description, reason=v.reason)
            for v in err.violations
        ])))
    return details


def as_error(exc: BaseException) -> errors.PlimsollError:
    """Ours as it is; anything else (a bug, a library's exception) as INTERNAL
    ENGINE_ERROR whose message quotes nothing of it. The exception is logged."""
    if isinstance(exc, errors.PlimsollError):
        return exc
    log.error("unexpected error while handling a request", exc_info=exc)
    return errors.Internal(UNEXPECTED_MESSAGE)


def to_status(err: BaseException) -> grpc.Status:
    err = as_error(err)
    return rpc_status.to_status(status_pb2.Status(code=code_of(err), message=err.message,
                                                  details=details_of(err)))


async def abort(context: grpc.aio.ServicerContext, err: BaseException):
    """Ends the RPC with `err`'s status. Accepts any exception (see `as_error`); gRPC's
    own abort (a nested `context.abort`) passes through."""
    if isinstance(err, grpc.aio.AbortError):
        raise err
    await context.abort_with_status(to_status(err))
