"""The engine options the benchmark's own servers share (bench/sse_server.py, frontend_lib/inproc.py), and the
AsyncEngine they start from them: the same engine as `engine-server` with the same flags."""

from __future__ import annotations

import argparse

from engine_server.cli import parse_size
from engine_server.core.loop import EngineFactory, default_engine_factory
from engine_server.engine.config import EngineConfig
from engine_server.frontend.async_engine import AsyncEngine


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="default: the tiny test model")
    p.add_argument("--device", default="cpu")
    p.add_argument("--kv-cache-memory", type=parse_size, default=256 * 2**20)
    p.add_argument("--simulated-engine", type=float, default=None, metavar="STEP_MS")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--num-threads", type=int, default=None)


def resolve_model(args: argparse.Namespace) -> None:
    """Fills in the tiny test model (built on first use) where no --model was given."""
    if args.model is None:
        from engine_server.models.tiny import default_model_dir

        args.model = str(default_model_dir())


async def start_engine(args: argparse.Namespace) -> AsyncEngine:
    config = EngineConfig(model=args.model, max_num_seqs=args.max_num_seqs, num_threads=args.num_threads,
                          device=args.device, kv_cache_memory_bytes=args.kv_cache_memory)
    factory: EngineFactory = default_engine_factory
    if args.simulated_engine is not None:
        from engine_server.engine.simulated import simulated_engine_factory

        factory = simulated_engine_factory(args.simulated_engine)
    return await AsyncEngine.start(config, engine_factory=factory)
