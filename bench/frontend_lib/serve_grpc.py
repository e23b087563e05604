"""engine-server with the simulated engine core: the shipped EngineServer, CLI flags and frontend; only the
engine factory differs (benchmarks of the frontend alone).

Usage: python -m frontend_lib.serve_grpc --simulated-engine STEP_MS [engine-server flags...]
Stops on SIGTERM (drain with a 5 s budget).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

from engine_server.api.server import EngineServer
from engine_server.cli import build_configs, build_parser
from engine_server.engine.simulated import simulated_engine_factory
from engine_server.frontend.async_engine import AsyncEngine


async def serve(args: argparse.Namespace) -> None:
    server_config, engine_config = build_configs(args)
    factory = simulated_engine_factory(args.simulated_engine)

    async def start_engine() -> AsyncEngine:
        return await AsyncEngine.start(engine_config, engine_factory=factory)

    server = EngineServer(server_config, engine_config=engine_config, start_engine=start_engine)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await server.start()
    await stop.wait()
    await server.close()


def main() -> None:
    parser = build_parser()
    parser.add_argument("--simulated-engine", type=float, required=True, metavar="STEP_MS")
    args = parser.parse_args()
    import uvloop

    uvloop.run(serve(args))
    sys.exit(0)


if __name__ == "__main__":
    main()
