"""InferenceService: Generate, mapped between the wire and the Generate pipeline."""

from __future__ import annotations

import grpc

from engine.errors import OutOfRange
from engine.request import Chunk, Finished
from plimsoll.v1 import inference_pb2_grpc
from service import convert, status
from service.generate import Admitted, GeneratePipeline


class InferenceServicer(inference_pb2_grpc.InferenceServiceServicer):
    def __init__(self, pipeline: GeneratePipeline, max_message_bytes: int) -> None:
        self._pipeline = pipeline
        self._max_message_bytes = max_message_bytes

    async def Generate(self, request, context: grpc.aio.ServicerContext):
        try:
            self._check_size(request)
            async for event in self._pipeline.generate(convert.spec_from_wire(request)):
                if isinstance(event, Chunk):
                    yield convert.chunk_to_wire(event)
                elif isinstance(event, Admitted):
                    yield convert.start_to_wire(event)
                elif isinstance(event, Finished):
                    yield convert.end_to_wire(event)
        except Exception as err:
            await status.abort(context, err)

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
