"""Domain errors → gRPC statuses with rich details (google.rpc.Status via grpcio-status)."""

from __future__ import annotations

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from engine import errors

DOMAIN = "plimsoll.dev"

_CODES: list[tuple[type[errors.PlimsollError], int]] = [
    (errors.InvalidArgument, code_pb2.INVALID_ARGUMENT),
    (errors.OutOfRange, code_pb2.OUT_OF_RANGE),
    (errors.NotFound, code_pb2.NOT_FOUND),
    (errors.FailedPrecondition, code_pb2.FAILED_PRECONDITION),
    (errors.Unavailable, code_pb2.UNAVAILABLE),
    (errors.ResourceExhausted, code_pb2.RESOURCE_EXHAUSTED),
    (errors.Aborted, code_pb2.ABORTED),
]


def _pack(message) -> any_pb2.Any:
    detail = any_pb2.Any()
    detail.Pack(message)
    return detail


def _retry(seconds: float) -> any_pb2.Any:
    delay = duration_pb2.Duration()
    delay.FromNanoseconds(int(seconds * 1e9))
    return _pack(error_details_pb2.RetryInfo(retry_delay=delay))


def to_status(err: errors.PlimsollError) -> grpc.Status:
    code = next((c for cls, c in _CODES if isinstance(err, cls)), code_pb2.INTERNAL)
    details: list[any_pb2.Any] = []
    if isinstance(err, errors.InvalidArgument | errors.OutOfRange) and err.field_name:
        violation = error_details_pb2.BadRequest.FieldViolation(
            field=err.field_name, description=err.message
        )
        details.append(_pack(error_details_pb2.BadRequest(field_violations=[violation])))
    elif isinstance(err, errors.NotFound):
        details.append(_pack(error_details_pb2.ResourceInfo(
            resource_type=err.resource or "resource", description=err.message)))
    elif isinstance(err, errors.FailedPrecondition) and err.reason:
        details.append(_pack(error_details_pb2.ErrorInfo(reason=err.reason, domain=DOMAIN)))
    elif isinstance(err, errors.ResourceExhausted | errors.Aborted):
        details.append(_pack(error_details_pb2.ErrorInfo(
            reason=err.reason, domain=DOMAIN, metadata=err.metadata)))
        details.append(_retry(err.retry_after_s))
    elif isinstance(err, errors.Unavailable):
        details.append(_retry(err.retry_after_s))
    return rpc_status.to_status(status_pb2.Status(code=code, message=err.message,
                                                  details=details))


async def abort(context: grpc.aio.ServicerContext, err: errors.PlimsollError):
    await context.abort_with_status(to_status(err))
