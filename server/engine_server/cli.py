"""`engine-server` (also `python -m engine_server`): serve one model over the engine.v1 gRPC API.

Errors in the command line or a missing model are one line on stderr and exit code 2, never a traceback.
Exit codes: 0 after a graceful stop (SIGTERM/SIGINT), 1 when the server could not start or was stopped by a
second signal, 2 for usage errors.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

from engine_server.adapter_flags import adapter_admin, adapter_engine_settings, add_adapter_flags
from engine_server.api.config import ServerConfig
from engine_server.api.security.auth import resolve_api_key
from engine_server.api.security.config import H2Policy, SecurityConfig
from engine_server.engine.config import DTYPES, EngineConfig

logger = logging.getLogger("engine_server")

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1,
    "B": 1,
    "K": 1000,
    "M": 1000**2,
    "G": 1000**3,
    "T": 1000**4,
    "KI": 2**10,
    "MI": 2**20,
    "GI": 2**30,
    "TI": 2**40,
}


class UsageError(Exception):
    """A bad command line or configuration: one line, exit code 2."""


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a default only when there is one worth showing (not None / False)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default in (None, False, "") or action.default is argparse.SUPPRESS:
            return action.help
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see {self.prog} --help)")


def parse_size(text: str) -> int:
    """Bytes from "268435456", "256MiB", "1GiB", "512M" (decimal), ..."""
    match = _SIZE.match(text)
    if match is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 268435456, 256MiB, 1GiB)")
    unit = (match.group(2) or "").upper().removesuffix("B")
    return int(float(match.group(1)) * _UNITS[unit])


def positive_int(text: str) -> int:
    """An int >= 1, checked while parsing (before any model is resolved or loaded)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


# NOTE: one convention for every numeric flag: N parses as an int, SECONDS as a float, SIZE as bytes.
def _count(
    group: argparse._ArgumentGroup, flag: str, *, default: int | None = None, help: str,
    type: Callable[[str], int] = int,
) -> None:
    group.add_argument(flag, type=type, metavar="N", default=default, help=help)


def _seconds(group: argparse._ArgumentGroup, flag: str, *, default: float, help: str) -> None:
    group.add_argument(flag, type=float, metavar="SECONDS", default=default, help=help)


def _size(group: argparse._ArgumentGroup, flag: str, *, default: str, help: str) -> None:
    group.add_argument(flag, type=parse_size, metavar="SIZE", default=default, help=help)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="engine-server",
        description="Serve one model over the engine.v1 gRPC API, with grpc.health.v1 and server "
        "reflection on the same port.",
        epilog="Stop with SIGTERM or Ctrl-C: health turns NOT_SERVING, in-flight streams get --drain-timeout "
        "seconds to finish, the rest are aborted; a second signal stops at once.",
        formatter_class=_HelpFormatter,
    )
    model = p.add_argument_group("model")
    model.add_argument(
        "--model",
        metavar="PATH",
        help="local model directory (config.json + weights + tokenizer); default: the "
        "embedded tiny demo model, built on first use (random weights, for testing)",
    )
    model.add_argument(
        "--served-model-name",
        default="",
        metavar="NAME",
        help="name reported to clients (default: the model directory's name)",
    )
    model.add_argument("--device", default="cpu", metavar="DEVICE", help="cpu, cuda or cuda:N")
    model.add_argument(
        "--dtype", default="auto", choices=DTYPES, help="weights' dtype (auto: float32 on cpu)"
    )
    model.add_argument(
        "--task",
        default="auto",
        choices=("auto", "generate", "embed"),
        help="what the model serves (auto: from its architecture)",
    )
    _count(model, "--max-model-len", help="max prompt + output tokens (default: the model's)")

    engine = p.add_argument_group("engine")
    _count(engine, "--max-num-seqs", default=256, help="sequences per engine step")
    _count(engine, "--max-num-batched-tokens", default=2048, help="tokens per engine step")
    _count(
        engine, "--max-waiting", default=1024,
        help="requests waiting for the scheduler; beyond: RESOURCE_EXHAUSTED",
    )
    _count(engine, "--block-size", default=16, help="tokens per KV cache block")
    _count(engine, "--num-kv-blocks", help="KV cache blocks (default: from --kv-cache-memory)")
    _size(engine, "--kv-cache-memory", default="256MiB", help="KV cache size, e.g. 256MiB or 2GiB")
    engine.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    _count(
        engine, "--num-threads", type=positive_int,
        help="torch CPU threads of the engine core (default: torch's, one per core; 1 is often fastest "
        "when other processes share the cores)",
    )
    _count(
        engine, "--structured-output-compile-threads", type=positive_int, default=1,
        help="threads compiling structured-output constraints (JSON schemas, regexes, grammars)",
    )
    _seconds(
        engine, "--structured-output-compile-timeout", default=10.0,
        help="longest a constraint may take to compile; past it the request is INVALID_ARGUMENT",
    )
    engine.add_argument(
        "--in-process-engine",
        action="store_true",
        help="run the engine core on a thread of this process instead of its own process",
    )
    # Hidden (benchmarks): a simulated engine core with a fixed step time, no model (engine/simulated.py).
    engine.add_argument("--simulated-engine", type=float, metavar="STEP_MS", help=argparse.SUPPRESS)
    _count(
        engine, "--api-workers", default=1,
        help="gRPC frontend processes sharing the port (SO_REUSEPORT) over one engine core process",
    )

    add_adapter_flags(p)

    net = p.add_argument_group("network")
    net.add_argument(
        "--host", default="127.0.0.1", metavar="ADDR", help="address to listen on (0.0.0.0: every interface)"
    )
    _count(net, "--port", default=50051, help="port (0: any free port; see --ready-file)")
    _count(
        net, "--max-concurrent-streams", default=1024,
        help="Generate streams in flight on the whole server (every --api-workers process together) and "
        "per HTTP/2 connection; beyond: RESOURCE_EXHAUSTED",
    )
    _size(
        net, "--max-receive-message-size", default="4MiB",
        help="largest request message; larger: RESOURCE_EXHAUSTED",
    )
    _seconds(
        net, "--keepalive-time", default=60.0,
        help="seconds of silence before the server pings a connection with calls in flight",
    )
    _seconds(
        net, "--keepalive-timeout", default=20.0,
        help="seconds to wait for the ping's answer before closing the connection",
    )
    net.add_argument("--no-reflection", action="store_true", help="do not serve gRPC server reflection")

    sec = p.add_argument_group("security")
    sec.add_argument(
        "--api-key",
        metavar="KEY",
        help="require `authorization: Bearer KEY` (or `x-api-key: KEY`) on every call but health and "
        "reflection (also: --api-key-file, or $ENGINE_API_KEY)",
    )
    sec.add_argument("--api-key-file", metavar="PATH", help="read the API key from this file")
    sec.add_argument("--tls-cert", metavar="PEM", help="server certificate chain (enables TLS)")
    sec.add_argument("--tls-key", metavar="PEM", help="server private key")
    sec.add_argument(
        "--tls-client-ca", metavar="PEM", help="require client certificates signed by this CA (mTLS)"
    )

    ops = p.add_argument_group("operations")
    _seconds(
        ops, "--drain-timeout", default=30.0,
        help="seconds in-flight streams get to finish on SIGTERM before they are aborted",
    )
    _count(
        ops, "--metrics-port",
        help="serve Prometheus metrics on this port (default: off); with --api-workers, one endpoint sums "
        "every process's counters",
    )
    ops.add_argument(
        "--ready-file",
        metavar="PATH",
        help='write {"port": N, "pid": P} here (atomically) once the server is SERVING',
    )
    ops.add_argument(
        "--log-level",
        default="info",
        choices=("debug", "info", "warning", "error"),
        help="log verbosity (logs go to stderr)",
    )
    return p


def _model_dir(path: str | None) -> str:
    if path is None:
        from engine_server.models.tiny import default_model_dir

        logger.info("no --model: using the embedded tiny demo model (random weights, for testing)")
        return str(default_model_dir())
    model_dir = Path(path)
    if not model_dir.is_dir():
        raise UsageError(f"--model: no such directory: {path} (a local model directory is required)")
    if not (model_dir / "config.json").is_file():
        raise UsageError(f"--model: {path} has no config.json (not a model directory)")
    return str(model_dir)


def build_configs(args: argparse.Namespace) -> tuple[ServerConfig, EngineConfig]:
    """Raises UsageError (one line) for anything invalid."""
    try:
        api_key = resolve_api_key(api_key=args.api_key, api_key_file=args.api_key_file)
        security = SecurityConfig(
            tls_cert_file=args.tls_cert,
            tls_key_file=args.tls_key,
            tls_client_ca_file=args.tls_client_ca,
            api_key=api_key,
            max_receive_message_size=args.max_receive_message_size,
            keepalive_time_s=args.keepalive_time,
            keepalive_timeout_s=args.keepalive_timeout,
            h2=H2Policy(max_concurrent_streams=args.max_concurrent_streams),
        )
        server = ServerConfig(
            host=args.host,
            port=args.port,
            served_model_name=args.served_model_name,
            max_concurrent_streams=args.max_concurrent_streams,
            drain_timeout_s=args.drain_timeout,
            enable_reflection=not args.no_reflection,
            metrics_port=args.metrics_port,
            ready_file=args.ready_file,
            in_process_engine=args.in_process_engine,
            api_workers=args.api_workers,
            security=security,
            adapter_admin=adapter_admin(args),
        )
        engine = EngineConfig(
            model=_model_dir(args.model),
            device=args.device,
            dtype=args.dtype,
            task=args.task,
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            block_size=args.block_size,
            num_kv_blocks=args.num_kv_blocks,
            kv_cache_memory_bytes=args.kv_cache_memory,
            max_waiting=args.max_waiting,
            enable_prefix_caching=not args.no_prefix_caching,
            num_threads=args.num_threads,
            grammar_compile_threads=args.structured_output_compile_threads,
            grammar_compile_timeout_s=args.structured_output_compile_timeout,
            **adapter_engine_settings(args),
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return server, engine


def _configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        _configure_logging(args.log_level)
        server_config, engine_config = build_configs(args)
    except UsageError as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    logger.info("engine-server %s (pid %d)", _version(), os.getpid())
    from engine_server.api.runner import run

    if server_config.in_process_engine:  # this process runs the engine (else the core's process does)
        from engine_server.engine.gpu_modules import keep_gpu_modules_out

        keep_gpu_modules_out(engine_config.device)
    factory = None
    if args.simulated_engine is not None:  # a dev/bench option: the frontend measured alone
        from engine_server.engine.simulated import simulated_engine_factory

        factory = simulated_engine_factory(args.simulated_engine)
    return run(server_config, engine_config, engine_factory=factory)


def _version() -> str:
    from engine_server import __version__

    return __version__
