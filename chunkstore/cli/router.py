"""``chunkstore router``: the OpenAI-compatible front door (chunkstore/router/)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from chunkstore.router.tokens import TOKENIZE, Tokenizer

if TYPE_CHECKING:
    from chunkstore.kv.keyspace import KeySpace

from .common import add_daemon_address

DESCRIPTION = """\
One OpenAI-compatible front door for vLLM instances that use the chunkstore connector
(/v1/completions and /v1/chat/completions, streamed or not; /v1/models, /health, /metrics).

Cold chunks (on by default): a chunked request's chunks that the instance's daemon does not
hold are first sent to the instance as their own prompts ("sys SEP chunk SEP", one output
token each, all at once; a chunk already on its way for another request is waited for), so
the request itself loads every chunk. A chunk computed as its own prompt is its isolated KV
on any attention back end: this is how chunks reach the store from live traffic where the
connector's in-band isolation hook does not run (CUDA, Ascend: the connector turns it off
there itself), and why a cold request is answered as a warm one.

Relevant documents last (--order, on by default): the documents most relevant to the
question (BM25, or the request's chunk_scores) are moved just before it, and the connector
leaves them to vLLM, which computes them seeing the others: the connector's default answers
where its hook does not run. A completion is sent as its reordered token IDs; a chat
request's message as its reordered text, if the instance tokenizes it to exactly those.

Prefill/decode (--prefill and --decode, or `chunkstore proxy`): the first token from a
prefill instance, the rest from a decode instance that loads the whole prompt from the
store; the reply joined, or streamed.

Settings: --connector-config is the instances' kv_connector_extra_config, the same JSON (or
@FILE holding it): the keys follow its separator, isolation, virtual_gap and
prefix_block_tokens, and the order its quality settings (relevant_last,
relevant_min_score, ...), so the router and the connectors decide alike. --model and --dtype
(vLLM's KV cache dtype) must be the instances' (a mismatch is counted in
chunkstore_router_cold_chunks_failed_total{why="not_stored"} and logged).

Routing: with several instances, each request goes to the one whose daemon holds most of its
tokens, per request in flight there; health checked every few seconds, an instance that
cannot be connected to is skipped.

Callers: no work is done for a request, and nothing said of the store, before its instance
admits the caller (GET /v1/models with the caller's API key, remembered --auth-ttl
seconds): a caller the instance refuses gets the instance's 401 and nothing else. Operators
(instance URLs, daemons, in-flight counts, the x-chunkstore-* reply headers, /metrics):
callers with --operator-token (x-chunkstore-operator: TOKEN, or Authorization: Bearer on
/metrics and /health); without a token, callers on this host only.

Bounds (defaults a small deployment never reaches): refused with 413 (--max-body-bytes),
408 (--body-timeout), a closed connection (--header-timeout), 503
(--max-client-connections); passed on without the router's work, counted in
chunkstore_router_fallbacks_total (--max-prompts, --max-chunks, and requests the instance
would refuse); cold chunks wait for a turn (--max-cold-in-flight) or are left to the request
(--max-cold-per-client). See docs/router.md."""


def run(args: argparse.Namespace) -> int:
    from chunkstore.policy.treatment import QualityConfig
    from chunkstore.router.app import RouterSettings
    from chunkstore.router.instances import parse_instance
    from chunkstore.router.limits import Limits

    if not args.instance and not (args.prefill and args.decode):
        print("chunkstore router: give --instance, or --prefill and --decode", file=sys.stderr)
        return 2
    if args.instance and (args.prefill or args.decode):
        print("chunkstore router: --instance, or --prefill and --decode: not both", file=sys.stderr)
        return 2
    try:
        _refuse_moved_flags(args)
        connector = connector_config(args.connector_config)
        quality = QualityConfig.from_extra(connector)  # the connector's, as it reads them
        operator_token = operator_token_of(args.operator_token)
        limits = Limits(**{name: getattr(args, name) for name in LIMITS})
        routed = [parse_instance(t, args.address) for t in args.instance or args.prefill]
        decode = [parse_instance(t, args.address) for t in args.decode or []]
        keys, tokenizer = None, None
        if args.model:
            tokenizer = Tokenizer.for_model(args.model)  # the keys' too: loaded once
            keys = key_space(args.model, args.dtype, connector, tokenizer.tokenizer)
            if args.tokenize == "instance":
                tokenizer = None
    except (OSError, ValueError, TypeError) as err:
        print(f"chunkstore router: {err}", file=sys.stderr)
        return 2
    settings = RouterSettings(
        keys,
        routed,
        decode,
        cold_chunks=args.cold_chunks == "on" and keys is not None,
        relevant_last=args.order == "relevant-last",
        quality=quality,
        tokenizer=tokenizer,
        timeout=args.timeout,
        max_connections=args.max_connections,
        health_interval=args.health_interval,
        daemon_token=args.token,
        limits=limits,
        operator_token=operator_token,
    )
    return serve(settings, args.host, args.port, args.log_level)


# The connector's settings the router once took as flags of its own: each is a key of
# --connector-config now, and the flag is refused saying so.
MOVED_FLAGS = {
    "separator": "--separator",
    "isolation": "--isolation",
    "virtual_gap": "--virtual-gap",
    "prefix_block_tokens": "--prefix-block-tokens",
}


def _refuse_moved_flags(args: argparse.Namespace) -> None:
    """ValueError where a moved flag is given."""
    given = sorted(flag for k, flag in MOVED_FLAGS.items() if getattr(args, k, None) is not None)
    if given:
        raise ValueError(
            f"{', '.join(given)}: the connector's settings; give them in --connector-config "
            "(the instances' kv_connector_extra_config JSON, e.g. "
            '\'{"separator": "##", "isolation": "sys"}\')'
        )


def connector_config(text: str) -> dict[str, Any]:
    """--connector-config: the instances' kv_connector_extra_config, a JSON object or @FILE
    holding one (ValueError, OSError)."""
    if text.startswith("@"):
        text = Path(text[1:]).read_text()
    try:
        config = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"--connector-config is not JSON: {err}") from None
    if not isinstance(config, dict):
        raise ValueError("--connector-config must be a JSON object (kv_connector_extra_config)")
    return config


def key_space(model: str, dtype: str, connector: dict[str, Any], tokenizer: Any) -> KeySpace:
    """The keys the instances' connectors make: the model folder, vLLM's KV cache dtype and
    the connector's separator (text, or token IDs), isolation, virtual_gap and
    prefix_block_tokens (those it does not give: the connector's defaults)."""
    from chunkstore.kv.keys import Isolation
    from chunkstore.kv.keyspace import KeySpace

    named: dict[str, Any] = {
        k: connector[k] for k in ("virtual_gap", "prefix_block_tokens") if k in connector
    }
    if "isolation" in connector:
        named["isolation"] = Isolation(connector["isolation"])
    separator = connector.get("separator", "auto")
    ids = None
    if isinstance(separator, list):  # token IDs, as the connector takes them
        ids, separator = tuple(int(t) for t in separator), "auto"
    keys = KeySpace.for_model(model, dtype, separator, tokenizer=tokenizer, **named)
    if ids is not None:
        keys = dataclasses.replace(keys, separator=ids, separator_text=tokenizer.decode(ids))
    return keys


def operator_token_of(flag: str | None) -> str | None:
    """--operator-token, else CHUNKSTORE_ROUTER_OPERATOR_TOKEN; None where neither is set.
    An empty one is refused (ValueError): it would make every caller the operator."""
    token = flag if flag is not None else os.environ.get("CHUNKSTORE_ROUTER_OPERATOR_TOKEN")
    if token is not None and not token.strip():
        raise ValueError(
            "the operator token (--operator-token or CHUNKSTORE_ROUTER_OPERATOR_TOKEN) is "
            "empty: give one, or unset it (operators are then callers on this host)"
        )
    return token


def serve(settings: Any, host: str, port: int, log_level: str) -> int:
    """Listen (the address printed as a JSON line once bound), then serve until SIGTERM or
    SIGINT (a clean exit, 0)."""
    import uvicorn

    from chunkstore.router.app import Router
    from chunkstore.router.server import http_protocol

    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise
    try:
        # The family the address is: IPv6 as well as IPv4 (``create_server`` assumes IPv4).
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        listener = socket.create_server((host, port), family=family)
    except OSError as err:
        print(f"chunkstore: cannot listen on {host}:{port}: {err}", file=sys.stderr)
        return 2
    app = Router(settings).app()
    limits = settings.limits
    config = uvicorn.Config(
        app,
        log_level=log_level,
        access_log=False,
        http=http_protocol(limits.header_timeout),
        limit_concurrency=limits.max_client_connections,
    )
    server = uvicorn.Server(config)
    bound, bound_port = listener.getsockname()[:2]
    bound = f"[{bound}]" if ":" in bound else bound
    print(json.dumps({"router": f"http://{bound}:{bound_port}"}), flush=True)
    # uvicorn stops gracefully on SIGTERM / SIGINT, then raises the signal again for the
    # handler it found: this one, so that a stop asked for is a clean exit.
    signal.signal(signal.SIGTERM, _exit_cleanly)
    signal.signal(signal.SIGINT, _exit_cleanly)
    server.run(sockets=[listener])
    return 0


def _exit_cleanly(signum: int, frame: object) -> None:
    raise SystemExit(0)


def add_commands(commands: Any) -> None:
    router = commands.add_parser(
        "router",
        help="OpenAI front door: cold chunks stored from live traffic, routing to the chunks",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    router.add_argument(
        "--instance",
        action="append",
        metavar="URL[=DAEMON]",
        help="a vLLM instance (repeatable), with the address of the daemon its connector "
        "uses when that is not --address",
    )
    router.add_argument(
        "--prefill",
        action="append",
        metavar="URL[=DAEMON]",
        help="prefill/decode instead: a prefill instance (kv_role kv_producer; repeatable), "
        "routed to as --instance is",
    )
    router.add_argument(
        "--decode",
        action="append",
        metavar="URL[=DAEMON]",
        help="a decode instance (kv_role kv_consumer; repeatable), the least loaded is used",
    )
    add_daemon_address(router)
    _add_key_arguments(router)
    router.add_argument(
        "--cold-chunks",
        choices=("on", "off"),
        default="on",
        help="store a request's missing chunks before it (on; off: only route)",
    )
    router.add_argument(
        "--order",
        choices=("relevant-last", "as-sent"),
        default="relevant-last",
        help="relevant-last (the default): each chunked prompt is sent with the documents "
        "most relevant to its question last, where vLLM computes them after loading the "
        "others: the connector's default answers on a back end without its in-band hook "
        "(CUDA, Ascend), the same KV with it; as-sent: prompts as they came (a request "
        'keeps its order with kv_transfer_params {"keep_order": true})',
    )
    router.add_argument(
        "--tokenize",
        choices=TOKENIZE,
        default="router",
        help="router (the default, with --model): a completion's text is tokenized here with "
        "the model folder's tokenizer, for an instance whose tokenizer is proven the same "
        "(its /tokenize and /detokenize on a probe set, at start-up and after it was down; "
        "chunkstore_router_tokenizer_proofs_total), and compared with its /tokenize one text "
        "in 64 (a difference: that instance tokenizes every prompt until proven again, "
        "chunkstore_router_tokenizer_mismatch_total); until proven, the instance tokenizes. "
        "instance: every prompt through the instance's /tokenize, a round trip a request. "
        "Chats are always tokenized by the instance (its chat template)",
    )
    router.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    router.add_argument("--port", type=int, default=8080, help="port to listen on (8080; 0: any)")
    router.add_argument(
        "--timeout", type=float, default=600.0, help="seconds an instance may take (600)"
    )
    router.add_argument(
        "--max-connections", type=int, default=256, help="to the instances, all together (256)"
    )
    router.add_argument(
        "--health-interval", type=float, default=5.0, help="seconds between health checks (5)"
    )
    _add_bounds(router)
    router.add_argument(
        "--log-level",
        default="warning",
        choices=("debug", "info", "warning", "error"),
        help="warning (default): instances going down or up, cold chunks not stored",
    )
    router.set_defaults(func=run)


def _add_key_arguments(router: argparse.ArgumentParser) -> None:
    """What makes the keys and the order: the connector's settings, which the router must
    share (--connector-config), the model and vLLM's KV cache dtype."""
    router.add_argument(
        "--model",
        help="the model folder the instances serve: the keys (without it: no cold chunks, "
        "routing by load only)",
    )
    router.add_argument(
        "--dtype", default="float32", help="the KV cache dtype vLLM runs with (float32)"
    )
    router.add_argument(
        "--connector-config",
        default="{}",
        metavar="JSON|@FILE",
        help="the instances' kv_connector_extra_config (the same JSON, or a file holding "
        "it): the keys (separator, isolation, virtual_gap, prefix_block_tokens) and the "
        "order (relevant_last, relevant_min_score, ...) follow it; its other keys are the "
        "connector's alone ({}: the connector's defaults)",
    )
    for flag in MOVED_FLAGS.values():  # moved into --connector-config: refused
        router.add_argument(flag, default=None, help=argparse.SUPPRESS)


# The router's bounds (chunkstore/router/limits.py): each flag, its default and what happens
# past it ("no help": passed on without the router's work, counted in fallbacks_total).
LIMITS = {
    "max_body_bytes": (int, "a request body's bytes (32 MiB): 413, told while it is read"),
    "body_timeout": (float, "seconds to read a request's body (60): 408"),
    "header_timeout": (float, "seconds to send a request's headers (10): the connection closed"),
    "max_client_connections": (int, "client connections at once (1024): 503 past it"),
    "max_prompts": (int, "prompts of a request the router tokenizes (64): past it, no help"),
    "max_chunks": (int, "pieces of a request (chunks, sys, prefix blocks) the router looks "
                   "up and stores (1024): past it, no help"),
    "max_cold_in_flight": (int, "cold chunks' prefills on their way, all requests (64): "
                           "the rest wait"),
    "max_cold_per_client": (int, "cold chunks of one client (API key, else address) sent or "
                            "waiting (256): past it, the request computes them"),
    "auth_ttl": (float, "seconds an instance's yes to an API key is remembered (60)"),
    "daemon_retry": (float, "seconds a daemon that failed a lookup is not asked (5)"),
}  # fmt: skip


def _add_bounds(router: argparse.ArgumentParser) -> None:
    from chunkstore.router.limits import Limits  # no router dependency: `--help` needs none

    defaults = Limits()
    for name, (kind, meaning) in LIMITS.items():
        flag = "--" + name.replace("_", "-")
        router.add_argument(flag, type=kind, default=getattr(defaults, name), help=meaning)
    router.add_argument(
        "--operator-token",
        help="the token operators send for /metrics, /health's detail and the x-chunkstore-* "
        "reply headers (or CHUNKSTORE_ROUTER_OPERATOR_TOKEN; unset: callers on this host)",
    )
