"""ControlService: models, memory, pins, admission, sessions — wire ↔ runtime."""

from __future__ import annotations

import grpc

from engine.errors import InvalidArgument, PlimsollError
from plimsoll.v1 import control_pb2, control_pb2_grpc
from service import convert, status
from service.runtime import Runtime


class ControlServicer(control_pb2_grpc.ControlServiceServicer):
    def __init__(self, runtime: Runtime) -> None:
        self._runtime = runtime

    async def ListModels(self, request, context):
        return control_pb2.ListModelsResponse(
            models=[convert.model_to_wire(e) for e in self._runtime.pool.entries()]
        )

    async def LoadModel(self, request, context):
        try:
            entry = await self._runtime.load_model(request.source, request.id)
        except PlimsollError as err:
            await status.abort(context, err)
        return control_pb2.LoadModelResponse(model=convert.model_to_wire(entry))

    async def UnloadModel(self, request, context):
        try:
            if not request.id:
                raise InvalidArgument("id is empty: name the model to unload", "id")
            result = await self._runtime.pool.unload(request.id, force=request.force)
        except PlimsollError as err:
            await status.abort(context, err)
        return control_pb2.UnloadModelResponse(
            freed_bytes=result.freed_bytes, aborted_requests=result.aborted_requests
        )

    # Defined in the contract, implemented by the enforcer and session-bank work.
    async def _unimplemented(self, context, name: str):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                            f"{name} is part of the contract but not implemented yet")

    async def Admit(self, request, context):
        await self._unimplemented(context, "Admit")

    async def Pin(self, request, context):
        await self._unimplemented(context, "Pin")

    async def Unpin(self, request, context):
        await self._unimplemented(context, "Unpin")

    async def WatchPressure(self, request, context):
        await self._unimplemented(context, "WatchPressure")

    async def GetMemoryStatus(self, request, context):
        await self._unimplemented(context, "GetMemoryStatus")

    async def ListSessions(self, request, context):
        await self._unimplemented(context, "ListSessions")

    async def DropSession(self, request, context):
        await self._unimplemented(context, "DropSession")
