"""Which adapter each of the fixed adapter slots holds: pins by requests, LRU replacement of idle ones.

A request pins its adapter's slot from admission until it ends (waiting, running, preempted: all pinned),
so a slot is never rewritten while a request that reads it is alive. An unpinned adapter stays resident
(its next request needs no copy) until its slot is wanted by another: the least recently released goes
first. Pure bookkeeping; the slot tensors are apply.py's.
"""

from __future__ import annotations

from collections import OrderedDict

from engine_server.engine.lora.errors import AdapterInUse, AdapterSlotsFull


class AdapterSlots:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots: must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self._slot_of: dict[str, int] = {}  # resident adapter -> its slot
        self._pins: dict[str, int] = {}  # resident adapter -> requests holding it (absent: 0)
        self._idle: OrderedDict[str, None] = OrderedDict()  # resident, unpinned; least recently used first
        self._free = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first

    def slot_of(self, name: str) -> int | None:
        return self._slot_of.get(name)

    def num_pins(self, name: str) -> int:
        return self._pins.get(name, 0)

    def acquire(self, name: str) -> tuple[int, bool]:
        """Pins `name`'s slot for one request: (slot, True) where the adapter must be copied into it first
        (it was not resident; an idle adapter may have been evicted for it)."""
        slot = self._slot_of.get(name)
        is_new = slot is None
        if slot is None:
            if self._free:
                slot = self._free.pop()
            elif self._idle:
                evicted, _ = self._idle.popitem(last=False)
                slot = self._slot_of.pop(evicted)
            else:
                raise AdapterSlotsFull(f"all {self.num_slots} adapter slots hold adapters in use by running "
                                       f"or waiting requests; retry later")
            self._slot_of[name] = slot
        self._idle.pop(name, None)
        self._pins[name] = self._pins.get(name, 0) + 1
        return slot, is_new

    def release(self, name: str) -> None:
        """One request holding `name` ended; the last one makes it idle (most recently used)."""
        count = self._pins[name] - 1
        if count:
            self._pins[name] = count
            return
        del self._pins[name]
        self._idle[name] = None

    def evict(self, name: str) -> None:
        """Frees `name`'s slot (the adapter is being unloaded); refused while requests hold it."""
        if self._pins.get(name):
            raise AdapterInUse(f"adapter {name!r} is used by {self._pins[name]} running or waiting requests")
        slot = self._slot_of.pop(name, None)
        self._idle.pop(name, None)
        if slot is not None:
            self._free.append(slot)

    def resident(self) -> dict[str, int]:
        return dict(self._slot_of)
