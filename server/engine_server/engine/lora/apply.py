"""Batched LoRA updates for a batch that mixes adapters and the base model (Punica / S-LoRA style).

Every adaptable linear gets a `LoraLayer`: each slot's A^T [in, R] and scaled B^T [R, out] stacked
([slots, in, R], [slots, R, out], R = max_lora_rank, zero past an adapter's own rank and for a slot whose
adapter does not target the module). One forward pass serves the whole batch: a `LoraStep` groups the
step's rows by slot once, and each adapted linear then adds, after its own output (packed or not),

    y[rows of slot s] += (x[rows of slot s] @ A[s]) @ B[s]

for all slots at once: the rows gathered into [slots, M, in] (M = the largest group; padding rows masked
to zero after the shrink), two bmm, and each row's update gathered back and added. Base-model rows get
exactly 0 added. The weights are never merged.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from engine_server.engine.lora.context import active_lora
from engine_server.engine.lora.loader import TARGET_NAMES, LoraAdapter

LAYER_ATTR = "engine_lora"  # the nn.Linear's LoraLayer, where the packed MLP forward finds it


class LoraLayer:
    """One adaptable linear's slots."""

    __slots__ = ("a", "b", "loaded_slots", "name")

    def __init__(self, name: str, in_features: int, out_features: int, *, num_slots: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.name = name
        self.a = torch.zeros(num_slots, in_features, max_rank, dtype=dtype, device=device)
        self.b = torch.zeros(num_slots, max_rank, out_features, dtype=dtype, device=device)
        self.loaded_slots: set[int] = set()  # slots whose adapter targets this module

    def write(self, slot: int, weights: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Puts an adapter's update for this module into `slot` (None: it does not target the module)."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        if weights is None:
            self.loaded_slots.discard(slot)
            return
        a, b = weights
        rank = a.shape[1]
        self.a[slot, :, :rank].copy_(a)
        self.b[slot, :rank, :].copy_(b)
        self.loaded_slots.add(slot)


class LoraStep:
    """One forward pass's rows by slot, and the batched update each adapted linear adds (`apply`)."""

    __slots__ = ("_all_rows", "_gather", "_inverse", "_last", "_mask", "_rank", "_slot_set", "_slots",
                 "_slots_view")

    def __init__(self, row_slots: Sequence[int], *, ranks: Mapping[int, int], device: torch.device) -> None:
        groups: dict[int, list[int]] = {}
        for row, slot in enumerate(row_slots):
            if slot >= 0:
                groups.setdefault(slot, []).append(row)
        slots = sorted(groups)
        self._slot_set = set(slots)
        self._rank = max(ranks[s] for s in slots)  # every slot's update fits in its first ranks columns
        # a contiguous run of slots is a view of the stacked weights, else they are gathered per linear
        self._slots_view = slice(slots[0], slots[-1] + 1) if slots[-1] - slots[0] == len(slots) - 1 else None
        self._slots = torch.tensor(slots, dtype=torch.long, device=device)
        width = max(len(rows) for rows in groups.values())
        num_adapted = sum(len(rows) for rows in groups.values())
        # NOTE: one adapter on every row (in order): no gather, no scatter, no padding
        self._all_rows = len(slots) == 1 and width == len(row_slots)
        if num_adapted < len(row_slots) and all(len(groups[s]) == width for s in slots):
            width += 1  # base-model rows read their (zero) update from a padding position
        # The rows laid out [slot, position]: a padding position reads row 0 and its shrunk value is zeroed,
        # so its update is exactly 0. `_inverse` takes each row's update back from that layout (a base row's
        # from a padding position): a gather into a contiguous [rows, out] then one add into the output,
        # which may be a strided view (a q/k/v part, gate's or up's columns), where index_add_ is ~10x slower.
        gather: list[int] = []
        inverse = [-1] * len(row_slots)
        pad_position = -1
        for s in slots:
            for row in groups[s]:
                inverse[row] = len(gather)
                gather.append(row)
            if len(groups[s]) < width:
                pad_position = len(gather)
            gather += [0] * (width - len(groups[s]))
        self._gather = torch.tensor(gather, dtype=torch.long, device=device).view(len(slots), width)
        self._inverse = torch.tensor([pad_position if i < 0 else i for i in inverse], dtype=torch.long,
                                     device=device)
        self._mask = None
        if pad_position >= 0:
            lengths = torch.tensor([len(groups[s]) for s in slots], device=device)
            self._mask = (torch.arange(width, device=device)[None, :] < lengths[:, None])[..., None]
        self._last: tuple[torch.Tensor, torch.Tensor] | None = None  # (x, its gathered rows): q/k/v share x

    def apply(self, module: Any, x: torch.Tensor, out: torch.Tensor) -> None:
        layer: LoraLayer | None = vars(module).get(LAYER_ATTR)
        if layer is not None and not layer.loaded_slots.isdisjoint(self._slot_set):
            self.add(layer, x, out)

    def add(self, layer: LoraLayer, x: torch.Tensor, out: torch.Tensor) -> None:
        rank = self._rank
        x2 = x.reshape(-1, x.shape[-1])
        y2 = out.view(-1, out.shape[-1])
        if self._slots_view is not None:
            a, b = layer.a[self._slots_view, :, :rank], layer.b[self._slots_view, :rank, :]
        else:
            a = layer.a.index_select(0, self._slots)[:, :, :rank]
            b = layer.b.index_select(0, self._slots)[:, :rank]
        if self._all_rows:
            y2.addmm_(x2 @ a[0], b[0])
            return
        last = self._last
        if last is not None and last[0] is x:
            gathered = last[1]
        else:
            gathered = x2[self._gather]  # [slots, M, in]
            self._last = (x, gathered)
        shrunk = torch.bmm(gathered, a)
        if self._mask is not None:
            shrunk.masked_fill_(~self._mask, 0)
        expanded = torch.bmm(shrunk, b).view(-1, y2.shape[-1])
        y2.add_(expanded.index_select(0, self._inverse))


class LoraLayers:
    """The model's adaptable linears and their slots; installs the hook on each linear's forward."""

    def __init__(self, model: torch.nn.Module, *, num_slots: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.device = device
        self.layers: dict[str, LoraLayer] = {}
        self.ranks: dict[int, int] = {}  # slot -> its adapter's rank
        for name, module in model.named_modules():
            if name.rsplit(".", 1)[-1] in TARGET_NAMES and isinstance(module, torch.nn.Linear):
                layer = LoraLayer(name, module.in_features, module.out_features, num_slots=num_slots,
                                  max_rank=max_rank, dtype=dtype, device=device)
                self.layers[name] = layer
                _install(module, layer)

    @property
    def modules(self) -> dict[str, tuple[int, int]]:
        """Adaptable module path -> (in_features, out_features)."""
        return {name: (layer.a.shape[1], layer.b.shape[2]) for name, layer in self.layers.items()}

    def write(self, slot: int, adapter: LoraAdapter) -> None:
        for name, layer in self.layers.items():
            layer.write(slot, adapter.weights.get(name))
        self.ranks[slot] = adapter.rank

    def step(self, row_slots: Sequence[int]) -> LoraStep | None:
        """The step's batch, or None where no row has an adapter (the forward adds nothing)."""
        if max(row_slots, default=-1) < 0:
            return None
        return LoraStep(row_slots, ranks=self.ranks, device=self.device)


def _install(module: torch.nn.Linear, layer: LoraLayer) -> None:
    """Wraps whatever forward the linear has now (its class's, or a packed GEMM / q|k|v part that
    packed_linears.py installed) with the update of the step's active LoRA batch."""
    inner: Callable[[torch.Tensor], torch.Tensor] = vars(module).get("forward") or module.forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        out = inner(x)
        batch = active_lora()
        if batch is not None:
            batch.apply(module, x, out)
        return out

    vars(module)[LAYER_ATTR] = layer
    vars(module)["forward"] = forward
