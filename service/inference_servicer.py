"""InferenceService: Generate, mapped between the wire and the runtime."""

from __future__ import annotations

import grpc
from plimsoll.v1 import inference_pb2_grpc

from engine.errors import PlimsollError
from engine.request import Chunk, Finished
from service import convert, status
from service.runtime import Admitted, Runtime


class InferenceServicer(inference_pb2_grpc.InferenceServiceServicer):
    def __init__(self, runtime: Runtime) -> None:
        self._runtime = runtime

    async def Generate(self, request, context: grpc.aio.ServicerContext):
        try:
            async for event in self._runtime.generate(convert.spec_from_wire(request)):
                if isinstance(event, Chunk):
                    yield convert.chunk_to_wire(event)
                elif isinstance(event, Admitted):
                    yield convert.start_to_wire(event)
                elif isinstance(event, Finished):
                    yield convert.end_to_wire(event)
        except PlimsollError as err:
            await status.abort(context, err)
