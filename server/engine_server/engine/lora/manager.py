"""The engine's adapters: loaded ones by name, slots pinned by requests, and their prefix-cache roots.

Loaded (`load`) means read, checked and held in memory; an adapter is copied into a slot (apply.py's
stacked tensors) when a request needs it and is not resident, evicting the least recently used idle one.
Runs on the engine's thread, like everything in engine/.
"""

from __future__ import annotations

import hashlib
import itertools

import torch

from engine_server.engine.lora.apply import LoraLayers, LoraStep
from engine_server.engine.lora.errors import AdapterExists, AdapterNotFound
from engine_server.engine.lora.loader import LoraAdapter, load_adapter
from engine_server.engine.lora.slots import AdapterSlots
from engine_server.engine.lora.types import AdapterInfo, check_adapter_name


class LoraManager:
    def __init__(self, model: torch.nn.Module, *, max_adapters: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        if max_rank < 1:
            raise ValueError(f"max_lora_rank: must be >= 1, got {max_rank}")
        self.max_rank = max_rank
        self._dtype, self._device = dtype, device
        self.layers = LoraLayers(model, num_slots=max_adapters, max_rank=max_rank, dtype=dtype, device=device)
        self.slots = AdapterSlots(max_adapters)
        self._adapters: dict[str, LoraAdapter] = {}
        # NOTE: a new number per load, so a name unloaded and loaded again with other weights never finds
        # the KV blocks its old weights computed
        self._roots: dict[str, int] = {}
        self._loads = itertools.count(1)

    def load(self, name: str, path: str, *, allowed_root: str | None = None) -> AdapterInfo:
        """Reads and checks the adapter; nothing changes if it is refused (an AdapterError)."""
        check_adapter_name(name)
        if name in self._adapters:
            raise AdapterExists(f"adapter {name!r} is already loaded")
        adapter = load_adapter(name, path, modules=self.layers.modules, max_rank=self.max_rank,
                               dtype=self._dtype, device=self._device, allowed_root=allowed_root)
        self._adapters[name] = adapter
        self._roots[name] = next(self._loads)
        return self.info(name)

    def unload(self, name: str) -> None:
        """Forgets the adapter; refused (AdapterInUse) while requests using it run or wait."""
        if name not in self._adapters:
            raise AdapterNotFound(f"no adapter named {name!r} is loaded")
        self.slots.evict(name)
        del self._adapters[name]
        del self._roots[name]

    def info(self, name: str) -> AdapterInfo:
        adapter = self._adapters[name]
        return AdapterInfo(name=name, rank=adapter.rank, lora_alpha=adapter.lora_alpha,
                           use_rslora=adapter.use_rslora, target_modules=adapter.target_modules,
                           num_requests=self.slots.num_pins(name),
                           is_resident=self.slots.slot_of(name) is not None)

    def infos(self) -> list[AdapterInfo]:
        return [self.info(name) for name in sorted(self._adapters)]

    def pin(self, name: str) -> int:
        """The slot a new request of `name` reads, held until `unpin`: copied in now if not resident.
        AdapterNotFound for an unknown name, AdapterSlotsFull where every slot is pinned by others."""
        adapter = self._adapters.get(name)
        if adapter is None:
            raise AdapterNotFound(f"no adapter named {name!r} is loaded")
        slot, is_new = self.slots.acquire(name)
        if is_new:
            self.layers.write(slot, adapter)
        return slot

    def unpin(self, name: str) -> None:
        self.slots.release(name)

    def cache_root(self, name: str, cache_salt: str) -> int:
        """The first KV block's parent hash for requests of this adapter load (and salt): never shared with
        the base model, another adapter, or an earlier load of the same name."""
        key = f"{self._roots[name]}\0{name}\0{cache_salt}".encode()
        digest = hashlib.blake2b(key, digest_size=8, person=b"lora_root").digest()
        return int.from_bytes(digest, "little", signed=True) or 1

    def step(self, row_slots: list[int]) -> LoraStep | None:
        return self.layers.step(row_slots)
