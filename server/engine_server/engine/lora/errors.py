"""Why an adapter was refused, as ValueError subclasses (torch-free: the frontends map them to statuses).

Each names the adapter and what is wrong with it in words an operator can act on; none embeds a path the
caller did not send.
"""

from __future__ import annotations


class AdapterError(ValueError):
    """An adapter operation was refused; nothing was loaded or changed."""


class AdapterNotFound(AdapterError):
    """No adapter of that name is loaded."""


class AdapterExists(AdapterError):
    """An adapter of that name is loaded already (unload it first)."""


class AdapterPathError(AdapterError):
    """The path is not a readable directory inside the adapter directory (symlinks resolved)."""


class AdapterFormatError(AdapterError):
    """The files are not a PEFT LoRA adapter this engine reads: config missing or unparseable, another PEFT
    type or option, missing / corrupt / oversized safetensors, tensors of the wrong shape or non-finite."""


class AdapterIncompatible(AdapterError):
    """The adapter targets modules the base model does not have (or that the engine does not adapt)."""


class AdapterRankTooLarge(AdapterError):
    """The adapter's rank is above the server's max_lora_rank."""


class AdapterInUse(AdapterError):
    """Unload refused: requests using the adapter are running or waiting."""


class AdapterSlotsFull(AdapterError):
    """Every adapter slot holds an adapter that running or waiting requests use."""


def rebuild(class_name: str, message: str) -> AdapterError:
    """The error `class_name` names (one of the above), for a refusal that crossed the core's pipe."""
    for cls in (AdapterNotFound, AdapterExists, AdapterPathError, AdapterFormatError, AdapterIncompatible,
                AdapterRankTooLarge, AdapterInUse, AdapterSlotsFull):
        if cls.__name__ == class_name:
            return cls(message)
    return AdapterError(message)
