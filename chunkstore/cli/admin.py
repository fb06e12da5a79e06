"""The operator's verbs against a running daemon (stats, evict, clear, pin, unpin, drain,
undrain), ``health`` for probes, and ``hash-token`` for a tenants file."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from .common import add_daemon_address


def _client(args: argparse.Namespace) -> Any:
    from chunkstore.client import ChunkStoreClient

    return ChunkStoreClient(
        args.address,
        token=args.token or None,
        transport="stream",
        name=f"chunkstore {args.command}",
    )


def _keys(hex_keys: list[str]) -> list[bytes]:
    try:
        return [bytes.fromhex(k) for k in hex_keys]
    except ValueError as err:
        raise SystemExit(f"keys are hex strings: {err}") from None


def _hash_token(args: argparse.Namespace) -> int:
    from chunkstore.daemon.tenants import hash_token

    token = sys.stdin.readline().strip()
    if not token:
        print("chunkstore hash-token: no token on stdin", file=sys.stderr)
        return 2
    print(hash_token(token))
    return 0


def run(args: argparse.Namespace) -> int:
    from google.protobuf.json_format import MessageToDict

    from chunkstore.errors import ChunkStoreError

    try:
        with _client(args) as client:
            if args.command == "stats":
                reply: Any = client.stats()
            elif args.command == "evict":
                reply = client.evict(_keys(args.keys), args.tenant)
            elif args.command == "clear":
                reply = client.clear()
            elif args.command in ("pin", "unpin"):
                changed = getattr(client, args.command)(_keys(args.keys), args.tenant)
                reply = {"changed": changed}
            elif args.command == "undrain":
                reply = {"was_draining": client.undrain()}
            else:
                reply = {"leases_left": client.drain(args.timeout)}
    except ChunkStoreError as err:
        print(f"chunkstore {args.command}: {err}", file=sys.stderr)
        return 1
    if not isinstance(reply, dict):
        reply = MessageToDict(
            reply, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
        )
    print(json.dumps(reply, indent=None if args.json else 2))
    return 0


def _health(args: argparse.Namespace) -> int:
    """Exit 0 if the daemon's gRPC health service answers SERVING (for probes)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        with grpc.insecure_channel(args.address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout
            )
    except grpc.RpcError as err:
        print(f"chunkstore health: {err.code().name}: {err.details()}", file=sys.stderr)
        return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(status)
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


def add_commands(commands: Any) -> None:
    admin_help = {
        "stats": "the daemon's counters and pool usage",
        "evict": "evict entries by key (leased or pinned ones stay)",
        "clear": "evict every entry that is neither leased nor pinned",
        "pin": "keep entries from eviction (e.g. a hot system prompt)",
        "unpin": "let pinned entries be evicted again",
        "drain": "stop new reads and writes, wait for leases to end",
        "undrain": "serve reads and writes again after a drain",
    }
    for verb, text in admin_help.items():
        sub = commands.add_parser(verb, help=text, description=text)
        add_daemon_address(sub)
        sub.add_argument("--json", action="store_true", help="one line of JSON")
        if verb in ("evict", "pin", "unpin"):
            sub.add_argument("keys", nargs="+", help="entry keys, hex")
            sub.add_argument(
                "--tenant",
                default="",
                help="whose keys, as the tenants file names them (default: the shared namespace)",
            )
        if verb == "drain":
            sub.add_argument(
                "--timeout", type=float, default=10.0, help="seconds to wait for leases"
            )
        sub.set_defaults(func=run)

    hashed = commands.add_parser(
        "hash-token",
        help="print the sha256 a tenants file holds for a bearer token (read from stdin)",
        description="Read a bearer token from stdin (one line) and print the token_sha256 "
        "a tenants file (serve --tenants) holds for it: the file never holds the token.",
    )
    hashed.set_defaults(func=_hash_token)

    health = commands.add_parser(
        "health",
        help="exit 0 if the daemon reports SERVING (container and k8s probes)",
        description="Ask the daemon's standard gRPC health service; exit 0 on SERVING, 1 "
        "otherwise. Needs no token.",
    )
    add_daemon_address(health, token=False)
    health.add_argument("--service", default="", help="service name ('' = the daemon)")
    health.add_argument("--timeout", type=float, default=3.0)
    health.set_defaults(func=_health)
