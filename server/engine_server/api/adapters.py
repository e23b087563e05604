"""engine.v1's LoRA adapter management RPCs (LoadAdapter, UnloadAdapter, ListAdapters) and the adapters
GetModelInfo / GetServerInfo show.

Admin operations (docs/adapters.md): off unless the operator enables them (`AdapterAdmin.enabled`,
--enable-adapter-admin); with an admin key configured (required where the server uses API keys), a call must
carry it in `x-admin-key`, compared in constant time, besides the API key every call carries (the security
layer checks that one first). The paths a LoadAdapter may name are confined by the engine, where the files
are read (engine/lora/loader.py: inside --adapter-dir, symlinks resolved).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from engine_proto.engine.v1 import adapters_pb2, info_pb2
from grpclib.const import Status
from grpclib.exceptions import GRPCError
from grpclib.server import Stream

from engine_server.api.errors import to_grpc_error
from engine_server.api.handle import EngineHandle
from engine_server.frontend.adapter_types import AdapterInfo

ADMIN_KEY_METADATA = "x-admin-key"


@dataclass(frozen=True, slots=True)
class AdapterAdmin:
    """Whether the management RPCs are served, and the key they require (None: none beyond the API key)."""

    enabled: bool = False
    admin_key: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        key = self.admin_key
        if key is not None and (not key or any(not 0x21 <= ord(ch) <= 0x7E for ch in key)):
            raise ValueError("admin_key must be non-empty printable ASCII without whitespace")
        if key is not None and not self.enabled:
            raise ValueError("admin_key: adapter management is off (enable it to use an admin key)")

    def check(self, metadata: Mapping[str, Any]) -> None:
        """PERMISSION_DENIED unless management is on and the call carries the admin key (where one is set)."""
        if not self.enabled:
            raise GRPCError(Status.PERMISSION_DENIED,
                            "adapter management is off on this server (--enable-adapter-admin)")
        if self.admin_key is None:
            return
        presented = metadata.get(ADMIN_KEY_METADATA)
        presented_bytes = presented.encode("utf-8", "surrogateescape") if isinstance(presented, str) else b""
        # NOTE: fixed-length digests: compare_digest then leaks nothing of the key's length
        if not hmac.compare_digest(hashlib.sha256(presented_bytes).digest(),
                                   hashlib.sha256(self.admin_key.encode("ascii")).digest()):
            raise GRPCError(Status.PERMISSION_DENIED, f"adapter management needs the admin key "
                                                      f"({ADMIN_KEY_METADATA} metadata)")


@runtime_checkable
class AdapterHandle(Protocol):
    """The adapter calls of the engine handle (`AsyncEngine`); a handle without them serves no adapters."""

    async def load_adapter(self, name: str, path: str) -> AdapterInfo: ...
    async def unload_adapter(self, name: str) -> None: ...
    async def list_adapters(self) -> list[AdapterInfo]: ...


def fill_adapter(msg: adapters_pb2.AdapterInfo, info: AdapterInfo, *, with_use: bool = True) -> None:
    msg.name = info.name
    msg.rank = info.rank
    msg.lora_alpha = info.lora_alpha
    msg.use_rslora = info.use_rslora
    msg.target_modules.extend(info.target_modules)
    if with_use:
        msg.num_requests = info.num_requests
        msg.is_resident = info.is_resident


async def loaded_adapters(engine: object) -> list[AdapterInfo]:
    """The adapters loaded now (a round trip to the core); [] for an engine that serves none (a fake, or the
    handle of an engine without adapter calls: EngineHandle does not require them)."""
    if not isinstance(engine, AdapterHandle):
        return []
    return await engine.list_adapters()


class AdapterRpcs:
    """The three RPCs, mixed into EngineServicer (which provides `_receive`)."""

    adapter_admin = AdapterAdmin()

    async def _receive(self, stream: Stream[Any, Any], *, rpc: str) -> tuple[Any, EngineHandle]:
        raise NotImplementedError  # EngineServicer's

    async def _admin_engine(self, stream: Stream[Any, Any], *, rpc: str) -> tuple[Any, AdapterHandle]:
        msg, handle = await self._receive(stream, rpc=rpc)
        self.adapter_admin.check(stream.metadata or {})
        engine: object = handle
        if not isinstance(engine, AdapterHandle):
            raise GRPCError(Status.FAILED_PRECONDITION, "this server serves no LoRA adapters")
        return msg, engine

    async def LoadAdapter(
        self, stream: Stream[adapters_pb2.LoadAdapterRequest, adapters_pb2.LoadAdapterResponse]
    ) -> None:
        msg, engine = await self._admin_engine(stream, rpc="LoadAdapter")
        try:
            info = await engine.load_adapter(msg.name, msg.path)
        except Exception as exc:
            raise to_grpc_error(exc, rpc="LoadAdapter") from None
        response = adapters_pb2.LoadAdapterResponse()
        fill_adapter(response.adapter, info)
        await stream.send_message(response)

    async def UnloadAdapter(
        self, stream: Stream[adapters_pb2.UnloadAdapterRequest, adapters_pb2.UnloadAdapterResponse]
    ) -> None:
        msg, engine = await self._admin_engine(stream, rpc="UnloadAdapter")
        try:
            await engine.unload_adapter(msg.name)
        except Exception as exc:
            raise to_grpc_error(exc, rpc="UnloadAdapter") from None
        await stream.send_message(adapters_pb2.UnloadAdapterResponse())

    async def ListAdapters(
        self, stream: Stream[adapters_pb2.ListAdaptersRequest, adapters_pb2.ListAdaptersResponse]
    ) -> None:
        _, engine = await self._admin_engine(stream, rpc="ListAdapters")
        try:
            infos = await engine.list_adapters()
        except Exception as exc:
            raise to_grpc_error(exc, rpc="ListAdapters") from None
        response = adapters_pb2.ListAdaptersResponse()
        for info in infos:
            fill_adapter(response.adapters.add(), info)
        await stream.send_message(response)


async def add_model_adapters(response: info_pb2.GetModelInfoResponse, engine: EngineHandle) -> None:
    """GetModelInfo's adapters (their use is ListAdapters', an admin call)."""
    for info in await loaded_adapters(engine):
        fill_adapter(response.adapters.add(), info, with_use=False)
