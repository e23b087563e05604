"""LoRA adapters: what the server reports of one (`AdapterInfo`) and the admin calls' messages.

Generate with an adapter: ``GenerateParams(adapter="name")`` (or ``adapter=`` on generate / complete). The
admin calls (``load_adapter``, ``unload_adapter``, ``list_adapters`` on both clients) need a server started
with --enable-adapter-admin; where it uses an admin key, set ``ConnectionOptions.admin_key``.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine_proto.engine.v1 import adapters_pb2

__all__ = ["AdapterInfo"]


@dataclass(frozen=True, slots=True)
class AdapterInfo:
    """A loaded LoRA adapter."""

    name: str
    rank: int
    lora_alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...]  # e.g. ("q_proj", "v_proj")
    num_requests: int = 0  # Generate requests using it now (ListAdapters / LoadAdapter only)
    is_resident: bool = False  # in one of the server's adapter slots now (ListAdapters / LoadAdapter only)


def adapter_info(msg: adapters_pb2.AdapterInfo) -> AdapterInfo:
    return AdapterInfo(name=msg.name, rank=msg.rank, lora_alpha=msg.lora_alpha, use_rslora=msg.use_rslora,
                       target_modules=tuple(msg.target_modules), num_requests=msg.num_requests,
                       is_resident=msg.is_resident)


def load_request(name: str, path: str) -> adapters_pb2.LoadAdapterRequest:
    if not isinstance(name, str) or not name:
        raise ValueError("name must be a non-empty str")
    if not isinstance(path, str) or not path:
        raise ValueError("path must be a non-empty str (relative to the server's adapter directory)")
    return adapters_pb2.LoadAdapterRequest(name=name, path=path)


def unload_request(name: str) -> adapters_pb2.UnloadAdapterRequest:
    if not isinstance(name, str) or not name:
        raise ValueError("name must be a non-empty str")
    return adapters_pb2.UnloadAdapterRequest(name=name)
