"""InferenceService: Generate, mapped between the wire and the Generate pipeline."""

from __future__ import annotations

import asyncio

import grpc

from engine.errors import CLIENT_STALLED, Aborted, OutOfRange
from engine.request import Chunk, Finished
from plimsoll.v1 import inference_pb2_grpc
from service import convert, status
from service.generate import Admitted, GeneratePipeline

# A stream whose client reads nothing for this long (HTTP/2 flow control holds the
# write) is ended: it would otherwise hold its batch slot and its model forever.
DEFAULT_STALL_TIMEOUT_S = 30.0


class InferenceServicer(inference_pb2_grpc.InferenceServiceServicer):
    def __init__(self, pipeline: GeneratePipeline, max_message_bytes: int,
                 stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S) -> None:
        self._pipeline = pipeline
        self._max_message_bytes = max_message_bytes
        self._stall_timeout_s = stall_timeout_s

    async def Generate(self, request, context: grpc.aio.ServicerContext):
        try:
            self._check_size(request)
            events = self._pipeline.generate(convert.spec_from_wire(request))
            try:
                await self._send(events, context)
            finally:
                await events.aclose()  # ends the engine request however the stream ends
        except Exception as err:
            await status.abort(context, err)

    async def _send(self, events, context: grpc.aio.ServicerContext) -> None:
        loop = asyncio.get_running_loop()
        stall = self._stall_timeout_s
        try:
            # One timeout, armed only while a write waits (never while the pipeline
            # queues, admits or prefills): no task or timer per token otherwise.
            async with asyncio.timeout(None) as window:
                async for event in events:
                    if isinstance(event, Chunk):
                        msg = convert.chunk_to_wire(event)
                    elif isinstance(event, Admitted):
                        msg = convert.start_to_wire(event)
                    elif isinstance(event, Finished):
                        msg = convert.end_to_wire(event)
                    else:
                        continue
                    window.reschedule(loop.time() + stall)
                    await context.write(msg)
                    window.reschedule(None)
        except TimeoutError:
            raise Aborted(f"the client read nothing for {stall:g} s (--stream-stall-timeout); "
                          "the request was ended", reason=CLIENT_STALLED,
                          retry_after_s=1.0) from None

    def _check_size(self, request) -> None:
        # The transport accepts up to twice this, so an oversized request gets a
        # status naming the field rather than a bare transport error.
        size = request.ByteSize()
        if size > self._max_message_bytes:
            field = {"text": "text", "token_ids": "token_ids.ids", "chat": "chat.messages"}
            name = field.get(request.WhichOneof("prompt") or "", "request")
            raise OutOfRange(
                f"request is {size} bytes; the limit is {self._max_message_bytes} "
                "(see --max-message-mb)",
                name,
            )
