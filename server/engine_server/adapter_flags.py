"""The LoRA adapter flags of `engine-server` (docs/adapters.md): engine settings and the admin switch."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from engine_server.api.adapters import AdapterAdmin


def add_adapter_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("LoRA adapters")
    group.add_argument(
        "--adapter", action="append", default=[], metavar="NAME=PATH",
        help="load a PEFT LoRA adapter at start (repeatable); requests name it in GenerateRequest.adapter",
    )
    group.add_argument(
        "--max-adapters", type=int, default=None, metavar="N",
        help="adapter slots: adapters running requests can use at once (default: 4 where --adapter, "
        "--adapter-dir or --enable-adapter-admin is given, else 0: no adapters)",
    )
    group.add_argument("--max-lora-rank", type=int, default=16, metavar="N",
                       help="the largest LoRA rank loaded")
    group.add_argument(
        "--adapter-dir", metavar="DIR",
        help="the directory LoadAdapter may read adapters from (paths resolved, symlinks included, and "
        "refused outside it); without it LoadAdapter is refused",
    )
    group.add_argument(
        "--enable-adapter-admin", action="store_true",
        help="serve LoadAdapter / UnloadAdapter / ListAdapters (admin calls; off by default)",
    )
    group.add_argument(
        "--admin-key", help="the key adapter admin calls carry in x-admin-key (required with --api-key; "
        "also --admin-key-file)",
    )
    group.add_argument("--admin-key-file", metavar="PATH", help="read the admin key from this file")


def _named_path(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--adapter: expected NAME=PATH, got {text!r}")
    return name, path


def adapter_engine_settings(args: argparse.Namespace) -> dict[str, Any]:
    """EngineConfig's adapter fields; ValueError for a bad flag."""
    adapters = tuple(_named_path(text) for text in args.adapter)
    if len({name for name, _ in adapters}) != len(adapters):
        raise ValueError("--adapter: a name is given twice")
    wanted = bool(adapters or args.adapter_dir or args.enable_adapter_admin)
    max_adapters = args.max_adapters if args.max_adapters is not None else (4 if wanted else 0)
    adapter_dir = None
    if args.adapter_dir:
        directory = Path(args.adapter_dir)
        if not directory.is_dir():
            raise ValueError(f"--adapter-dir: {args.adapter_dir!r} is not a directory")
        adapter_dir = str(directory.resolve())
    return {"max_adapters": max_adapters, "max_lora_rank": args.max_lora_rank, "adapters": adapters,
            "adapter_dir": adapter_dir}


def adapter_admin(args: argparse.Namespace) -> AdapterAdmin:
    if args.admin_key and args.admin_key_file:
        raise ValueError("--admin-key and --admin-key-file: give one")
    key = args.admin_key
    if args.admin_key_file:
        key = Path(args.admin_key_file).read_text().strip()
    return AdapterAdmin(enabled=args.enable_adapter_admin, admin_key=key or None)
