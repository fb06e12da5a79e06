"""The ``chunkstore`` command."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import sys
from pathlib import Path
from typing import Any

from chunkstore.models import DEFAULT_MODELS, MODELS, SUMMARIES, ModelBuildError, model_dir

# Bench name -> what it measures. Each is the module chunkstore.bench.NAME, with
# add_arguments(parser) and run(args) -> rows; imported only by `chunkstore bench` (the benches
# load torch and vLLM's helpers, seconds that `chunkstore serve` and the admin verbs skip).
BENCHES: dict[str, str] = {
    "remap": "RoPE remap + paged write of a chunk against a plain copy (ratio_vs_copy)",
    "device": "the GPU / NPU paths (remap + write, IPC get, pinned host pool) against plain "
    "device copies of the same bytes (ratio_vs_baseline)",
    "e2e": "time to first token in vLLM: no connector, prefix caching, chunkstore (ttft_speedup)",
    "pull": "a peer pull of one entry over Mooncake's Transfer Engine vs the gRPC stream "
    "(pull_engine_vs_stream)",
    "quality": "answer accuracy on generated multi-document QA, per recovery method, with TTFT",
    "scale": "the daemon at 1k / 10k / 100k entries, with pinned entries, and with 1-8 readers",
    "store": "daemon lookups, and reads via shared memory against memcpy, Redis and gRPC",
    "workload": "RAG traffic through vLLM's OpenAI server: its prefix caching alone vs "
    "chunkstore evicting by LRU and by worth, at pool sizes (throughput_vs_apc)",
}


def _bench_module(name: str) -> Any:
    return importlib.import_module(f"chunkstore.bench.{name}")


def _print_table(rows: list[dict[str, Any]]) -> None:
    if not rows:
        return
    columns = list(rows[0])
    widths = [max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in columns]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)))
    for row in rows:
        print("  ".join(str(row.get(c, "")).ljust(w) for c, w in zip(columns, widths, strict=True)))


def _bench(args: argparse.Namespace) -> int:
    rows = []
    for row in _bench_module(args.name).run(args):
        if args.json:
            print(json.dumps(row), flush=True)
        rows.append(row)
    if not args.json:
        _print_table(rows)
    return 0


def _models(args: argparse.Namespace) -> int:
    unknown = sorted(set(args.names) - set(MODELS))
    if unknown:
        print(
            f"chunkstore models: unknown model {', '.join(unknown)}; known: {', '.join(MODELS)}",
            file=sys.stderr,
        )
        return 2
    for name in args.names or DEFAULT_MODELS:
        try:
            built = model_dir(name, args.cache_dir, log=lambda line: print(line, file=sys.stderr))
        except ModelBuildError as error:
            print(f"chunkstore models: {name}: {error}", file=sys.stderr)
            return 1
        print(built, flush=True)
    return 0


def _serve(args: argparse.Namespace) -> int:
    from chunkstore.daemon import config as config_module
    from chunkstore.daemon.server import serve
    from chunkstore.errors import ChunkStoreError

    names = {f.name for f in dataclasses.fields(config_module.ServeConfig)}
    flags = {k: v for k, v in vars(args).items() if k in names}
    try:
        config = config_module.load(args.config, flags=flags)
        return serve(config)
    except (ChunkStoreError, OSError, RuntimeError) as err:  # grpc: RuntimeError on bind
        print(f"chunkstore serve: {err}", file=sys.stderr)
        return 2


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


def _admin(args: argparse.Namespace) -> int:
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


def _prompts(args: argparse.Namespace, sys_text: str | None) -> Any:
    from chunkstore.kv.keys import Isolation
    from chunkstore.prompts import RagPrompts

    return RagPrompts.for_model(
        args.model,
        sys_text,
        args.dtype,
        chat=args.chat,
        separator=args.separator,
        isolation=Isolation(getattr(args, "isolation", "sys")),
        virtual_gap=getattr(args, "virtual_gap", 0),
        cache_salt=getattr(args, "cache_salt", ""),
        chat_template=Path(args.chat_template).read_text() if args.chat_template else None,
    )


def _sys_text(args: argparse.Namespace) -> str | None:
    return Path(args.sys_file).read_text() if args.sys_file else args.sys


def _ingest(args: argparse.Namespace) -> int:
    from chunkstore.client import ChunkStoreClient
    from chunkstore.errors import ChunkStoreError
    from chunkstore.ingest import Refused, ServerBackend, ingest, print_progress, read_corpus

    sys_text = _sys_text(args)
    if sys_text is None and not args.chat:
        print("chunkstore ingest: give --sys TEXT or --sys-file FILE", file=sys.stderr)
        return 2
    try:
        chunks = read_corpus(args.corpus)
        prompts = _prompts(args, sys_text)

        def refused(r: Refused) -> None:
            print(
                f"chunkstore ingest: {args.corpus} chunk {r.index + 1} not stored: {r.why} "
                "(chunkstore check-separator says how to fix it)",
                file=sys.stderr,
            )

        backend = ServerBackend(args.server, args.served_model_name or args.model)
        with ChunkStoreClient(args.address, token=args.token or None) as client:
            summary = ingest(
                backend,
                client,
                prompts,
                chunks,
                args.batch_size,
                None if args.quiet else print_progress,
                refused,
            )
    except (ChunkStoreError, OSError, ValueError) as err:
        print(f"chunkstore ingest: {err}", file=sys.stderr)
        return 1
    print(json.dumps(dataclasses.asdict(summary)))
    return 0 if summary.failed == 0 else 1


def _check_separator(args: argparse.Namespace) -> int:
    """Exit 1 if some document's tokens change beside the separator."""
    from chunkstore.ingest import read_corpus
    from chunkstore.prompts import SPECIAL_SEPARATORS, default_separator, is_special

    try:
        chunks = read_corpus(args.corpus)
        sys_text = _sys_text(args)
        prompts = _prompts(args, sys_text if args.chat else sys_text or "")
    except (OSError, ValueError) as err:
        print(f"chunkstore check-separator: {err}", file=sys.stderr)
        return 2
    problems = [(i, why) for i, c in enumerate(chunks) if (why := prompts.check(c))]
    special = is_special(prompts.tokenizer, prompts.sep_text)
    if special:
        fix = "reword these documents (a special-token separator never merges with text)"
    elif (auto := default_separator(prompts.tokenizer)) != prompts.sep_text:
        fix = (
            f"use the special token {auto!r} as separator (separator 'auto', the default): "
            "it is split off before BPE and never merges"
        )
    else:
        fix = (
            "this vocabulary has none of the special tokens 'auto' picks from "
            f"({', '.join(SPECIAL_SEPARATORS)}): choose a separator text that no document "
            "starts or ends with, or reword these documents"
        )
    for index, why in problems:
        text = chunks[index]
        shown = text if len(text) <= 60 else text[:28] + " ... " + text[-27:]
        print(f"{args.corpus} chunk {index + 1}: {why}: {shown!r}")
    print(
        json.dumps(
            {
                "separator": prompts.sep_text,
                "separator_ids": prompts.sep_ids,
                "special_token": special,
                "chunks": len(chunks),
                "differ": len(problems),
                **({"fix": fix} if problems else {}),
            }
        )
    )
    return 1 if problems else 0


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


def _add_daemon_address(parser: argparse.ArgumentParser, token: bool = True) -> None:
    from chunkstore.protocol.endpoints import default_address

    parser.add_argument(
        "--address",
        default=default_address(),
        help="the daemon: unix:/path or host:port (default: the default socket)",
    )
    if token:
        parser.add_argument(
            "--token",
            default=None,
            help="bearer token, if the daemon has one (evict, clear, pin, unpin, drain and "
            "undrain need its admin token)",
        )


def _add_prompt_shape(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", required=True, help="the model folder vLLM serves (its weights key the entries)"
    )
    parser.add_argument(
        "--chat",
        action="store_true",
        help="chat requests (/v1/chat/completions): sys is the system message as the model's "
        "chat template renders it, the documents are in the user message",
    )
    parser.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE",
        help="with --chat: the template vLLM serves with, if it was started with "
        "--chat-template (default: the model's own)",
    )
    parser.add_argument(
        "--sys",
        default=None,
        help="the sys prompt (the system message with --chat; none there if left out)",
    )
    parser.add_argument("--sys-file", default=None, help="... or a file holding it")
    parser.add_argument(
        "--separator",
        default="auto",
        help="as the connector's: auto (default: a special token of the vocabulary where it "
        "has a free one, <file_sep> for SmolLM2, else ##), a text, or a special token",
    )
    parser.add_argument(
        "--dtype", default="float32", help="the KV cache dtype vLLM runs with (default float32)"
    )


def _proxy(args: argparse.Namespace) -> int:
    from chunkstore.proxy import Proxy, serve

    server = serve(args.host, args.port, Proxy(args.prefill, args.decode, args.timeout))
    port = server.server_address[1]
    print(json.dumps({"proxy": f"http://{args.host}:{port}"}), flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


def build_parser(bench_arguments: bool | str = True) -> argparse.ArgumentParser:
    """The whole command line. ``bench_arguments``: whose own arguments (and the imports they
    need) the benches get: every bench's (True), none (False, for any command but ``bench``),
    or the one named (``chunkstore bench NAME``: a bench imports only its own module, so
    ``bench device`` runs where vLLM and Redis are not installed)."""
    parser = argparse.ArgumentParser(
        prog="chunkstore",
        description="Position-independent KV-cache service for LLM serving.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    bench = commands.add_parser(
        "bench",
        help="measure against a baseline, side by side in one run",
        description="Benchmarks. Each prints a table, or with --json one JSON object per line "
        "with a 'bench' field and its figures; ratios are measured side by side.",
    )
    benches = bench.add_subparsers(dest="name", required=True, metavar="NAME")
    for name, summary in BENCHES.items():
        sub = benches.add_parser(name, help=summary, description=summary)
        if bench_arguments is True or bench_arguments == name:
            _bench_module(name).add_arguments(sub)
        sub.add_argument("--json", action="store_true", help="one JSON object per line")
        sub.set_defaults(func=_bench)

    models = commands.add_parser(
        "models",
        help="build the test models (tiny random Llama, SmolLM2, Qwen2.5) once and cache them",
        description="Build the models tests and benches use, each printed as its folder.\n"
        "A present model is never rebuilt. Default location: $CHUNKSTORE_MODEL_CACHE or\n"
        "~/.cache/chunkstore/models.\n\nmodels (fp32; size on disk, build time on 2 cores):\n"
        + "\n".join(f"  {name:14}{summary}" for name, summary in SUMMARIES.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    models.add_argument(
        "names",
        nargs="*",
        help=f"any of {', '.join(MODELS)} (default: {', '.join(DEFAULT_MODELS)})",
    )
    models.add_argument("--cache-dir", type=Path, default=None)
    models.set_defaults(func=_models)

    from chunkstore.daemon.config import add_flags

    serve = commands.add_parser(
        "serve",
        help="run the daemon that owns the chunk pool",
        description="Run the per-node daemon: a shared-memory chunk pool and its content-hash "
        "index behind gRPC on a unix socket and 127.0.0.1 TCP, with Prometheus "
        "metrics. Settings come from defaults < --config (TOML) < CHUNKSTORE_* "
        "environment < these flags; the result is logged on start. Prints one "
        "JSON 'ready' line with the bound addresses. SIGTERM drains and exits 0.",
    )
    serve.add_argument(
        "--config",
        default=None,
        help="TOML file of settings (names as the flags, with underscores)",
    )
    add_flags(serve)
    serve.set_defaults(func=_serve)

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
        _add_daemon_address(sub)
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
        sub.set_defaults(func=_admin)

    ingest = commands.add_parser(
        "ingest",
        help="pre-warm a corpus of chunks under a sys prompt through vLLM",
        description="Send each chunk of a corpus through a running vllm serve that has the "
        "connector, as the app will send it (text 'sys SEP chunk SEP', or with --chat a "
        "system message and a user message 'SEP chunk SEP' rendered by the model's chat "
        "template), so later RAG requests load it instead of computing it. Chunks already "
        "stored are skipped; chunks whose tokens change beside the separator are not sent "
        "(see check-separator). Prints a JSON summary: chunks, tokens, stored, "
        "already_present, failed; exits 1 if any failed.",
    )
    ingest.add_argument("corpus", help="one chunk per line: text, or JSON lines with 'text'")
    _add_prompt_shape(ingest)
    ingest.add_argument(
        "--server",
        default="http://127.0.0.1:8000",
        help="vllm serve's base URL (default http://127.0.0.1:8000)",
    )
    ingest.add_argument(
        "--served-model-name",
        default=None,
        help="the model name the server answers to (default: --model)",
    )
    _add_daemon_address(ingest)
    ingest.add_argument("--isolation", choices=["sys", "none"], default="sys")
    ingest.add_argument(
        "--virtual-gap",
        type=int,
        default=0,
        help="as the connector's virtual_gap (default 0): it is part of the chunks' keys",
    )
    ingest.add_argument(
        "--cache-salt",
        default="",
        help="vLLM's cache_salt, as the app's requests will carry it: part of every key, so "
        "only requests with the same salt load these chunks (default: none, the shared "
        "namespace)",
    )
    ingest.add_argument("--batch-size", type=int, default=8, help="chunks per request (8)")
    ingest.add_argument("--quiet", action="store_true", help="no progress bar")
    ingest.set_defaults(func=_ingest)

    hashed = commands.add_parser(
        "hash-token",
        help="print the sha256 a tenants file holds for a bearer token (read from stdin)",
        description="Read a bearer token from stdin (one line) and print the token_sha256 "
        "a tenants file (serve --tenants) holds for it: the file never holds the token.",
    )
    hashed.set_defaults(func=_hash_token)

    check = commands.add_parser(
        "check-separator",
        help="find the documents whose tokens change beside the separator",
        description="A separator written as text can merge with the text around it (with "
        "SmolLM2's '##', a document ending in '#'), which changes the chunk's tokens: it "
        "never hits, or splits in the wrong place. For each document of CORPUS, compare "
        "its tokens in a request (between sys and a question, in the chat or text shape) "
        "with its tokens alone; print each one that differs and why, then a JSON summary "
        "with the fix. Exit 1 if any differs.",
    )
    check.add_argument("corpus", help="one chunk per line: text, or JSON lines with 'text'")
    _add_prompt_shape(check)
    check.set_defaults(func=_check_separator)

    proxy = commands.add_parser(
        "proxy",
        help="prefill/decode disaggregation in front of vLLM instances sharing chunkstore",
        description="Send each OpenAI request (completions or chat, one prompt, not streamed) "
        "to a prefill instance (kv_role kv_producer) for its first token, then to a decode "
        "instance (kv_role kv_consumer) for the rest: the decode instance loads the whole "
        "prompt's KV from chunkstore and computes none of it. Instances are used in turn. "
        "See docs/connector.md, 'Prefill/decode disaggregation'.",
    )
    proxy.add_argument(
        "--prefill", action="append", required=True, metavar="URL", help="repeatable"
    )
    proxy.add_argument("--decode", action="append", required=True, metavar="URL", help="repeatable")
    proxy.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    proxy.add_argument("--port", type=int, default=8000, help="port to listen on (8000; 0: any)")
    proxy.add_argument(
        "--timeout", type=float, default=600.0, help="seconds per instance request (600)"
    )
    proxy.set_defaults(func=_proxy)

    health = commands.add_parser(
        "health",
        help="exit 0 if the daemon reports SERVING (container and k8s probes)",
        description="Ask the daemon's standard gRPC health service; exit 0 on SERVING, 1 "
        "otherwise. Needs no token.",
    )
    _add_daemon_address(health, token=False)
    health.add_argument("--service", default="", help="service name ('' = the daemon)")
    health.add_argument("--timeout", type=float, default=3.0)
    health.set_defaults(func=_health)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    named = argv[1] if argv[:1] == ["bench"] and len(argv) > 1 else argv[:1] == ["bench"]
    args = build_parser(bench_arguments=named).parse_args(argv)
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
