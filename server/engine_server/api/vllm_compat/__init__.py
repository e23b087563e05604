"""The vLLM-compatible worker service (`vllm.grpc.engine.VllmEngine`) that the smg gateway routes to.

Messages come from the `smg-grpc-proto` package (a dependency, not part of our contract).
"""

from __future__ import annotations

from .service import SERVICE_NAME
from .servicer import VllmCompatOptions, VllmEngineServicer, vllm_handlers

__all__ = ["SERVICE_NAME", "VllmCompatOptions", "VllmEngineServicer", "vllm_handlers"]
