"""Request bytes that do not parse end INVALID_ARGUMENT, with the reason, not UNKNOWN.

grpc.aio answers a request its deserializer cannot parse (invalid UTF-8 in a string
field, garbage bytes) with UNKNOWN and the exception's text, before any servicer runs.
This interceptor wraps each method's deserializer once: a parse failure becomes a marker
that the wrapped behaviour turns into our INVALID_ARGUMENT (reason MALFORMED_REQUEST,
through the one error table) naming the message type.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from engine.errors import MALFORMED_REQUEST, InvalidArgument
from service import status


class _Undecodable:
    __slots__ = ("error",)

    def __init__(self, error: InvalidArgument) -> None:
        self.error = error


def _safe(deserializer: Callable[[bytes], Any], method: str) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as exc:  # noqa: BLE001 - any parse failure is the client's bytes
            return _Undecodable(InvalidArgument(
                f"the request to {method} is not a valid message of its type: {exc}",
                "request", reason=MALFORMED_REQUEST))
    return parse


def _unary(behavior: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    async def run(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, _Undecodable):
            await status.abort(context, request.error)
        return await behavior(request, context)
    return run


def _streaming(behavior: Callable[..., Any]) -> Callable[..., Any]:
    async def run(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, _Undecodable):
            await status.abort(context, request.error)
        out = behavior(request, context)
        if inspect.isasyncgen(out):
            async for response in out:
                yield response
        else:  # a behaviour that writes through context.write
            await out
    return run


class DecodeGuard(grpc.aio.ServerInterceptor):
    """Wraps unary-request handlers (the only kind whose request arrives before the
    servicer runs). The wrapping of a handler is made once and kept for as long as the
    interceptors after this one hand back that same handler (the servicer's own, when
    this one is last)."""

    def __init__(self) -> None:
        self._wrapped: dict[str, tuple[Any, Any]] = {}  # method -> (handler, wrapped)

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        handler = await continuation(handler_call_details)
        kept = self._wrapped.get(method)
        if kept is not None and kept[0] is handler:
            return kept[1]
        wrapped = handler
        if handler is not None and not handler.request_streaming and handler.request_deserializer:
            safe = _safe(handler.request_deserializer, method)
            if handler.unary_unary is not None:
                wrapped = handler._replace(request_deserializer=safe,
                                           unary_unary=_unary(handler.unary_unary))
            elif handler.unary_stream is not None:
                wrapped = handler._replace(request_deserializer=safe,
                                           unary_stream=_streaming(handler.unary_stream))
        self._wrapped[method] = (handler, wrapped)
        return wrapped
