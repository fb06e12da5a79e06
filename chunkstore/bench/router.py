"""``chunkstore bench router``: what ``chunkstore router`` costs a request and where it sends
it, each against going straight to the instance.

Two ``vllm serve`` instances with the connector's in-band hook off (``inband_isolation:
false``: what a CUDA or Ascend back end runs), each on its own daemon, the daemons sharing a
Redis directory (a Redis started for the bench), and one router in front of both. Requests
are RAG prompts (``sys SEP doc SEP doc SEP doc SEP question``) over generated documents,
sent one at a time, each answered with one token (its latency is its time to first token):
- ``cold``: ``--requests`` requests over documents nobody stored, through the router (it
  sends the missing documents first as their own prompts, stores them, puts the relevant
  ones last) and, over as many other new documents, straight to the first instance (vLLM
  computes every prompt whole); the two alternate. ``router_vs_straight`` is the router's
  median over going straight's (below 1: the router is faster).
- ``warm``: every request of the cold pass again, the same way: what the router adds to a
  request whose work is done (both hit vLLM's prefix cache); the issue's bound is 1.05.
- ``placement``: ``--requests`` requests over documents stored on the second instance only
  (its daemon), through the router: the share it sends there (``placed``), and their median
  against the same requests straight to the first instance, which holds none of them.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from chunkstore.models import WORDS, model_dir

SYS = "Answer the question from the documents."
QUESTION = "Question {n}: what do these documents say about {word}?"
ROUTED = "x-chunkstore-instance"  # the instance a request went to (operators: loopback here)


def run(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    import httpx

    from chunkstore.processes.daemon import start_daemon
    from chunkstore.processes.redis import RedisServer
    from chunkstore.processes.router import RunningRouter
    from chunkstore.processes.vllm_server import VllmServer
    from chunkstore.prompts import RagPrompts

    model = Path(args.model) if Path(args.model).is_dir() else model_dir(args.model)
    prompts = RagPrompts.for_model(model, SYS)
    rng = random.Random(args.seed)
    figures = {"bench": "router", "model": args.model, "requests": args.requests, "k": args.k}

    def node(work: Path, name: str, redis: str) -> tuple[Any, VllmServer]:
        cluster = ("--redis", redis, "--node", name)
        daemon = start_daemon(work / f"{name}-daemon", *cluster, pool_bytes=256 << 20)
        settings = {"address": daemon.unix, "inband_isolation": False}
        try:
            return daemon, VllmServer(model, work / f"{name}-vllm", settings)
        except BaseException:
            daemon.stop()
            raise

    with (
        tempfile.TemporaryDirectory(prefix="chunkstore-router-") as tmp,
        RedisServer(Path(tmp) / "redis") as redis,
    ):
        work = Path(tmp)
        _progress("two instances, each on its own daemon, one Redis directory")
        with ThreadPoolExecutor(2) as starting:
            starts = [starting.submit(node, work, n, redis.url) for n in ("node-a", "node-b")]
            nodes = [s.result() for s in starts if s.exception() is None]
        try:
            if len(nodes) < 2:
                raise SystemExit(f"an instance did not start: {[s.exception() for s in starts]}")
            (daemon_a, first), (daemon_b, second) = nodes
            router = RunningRouter(
                work / "router",
                *("--instance", f"{first.url}={daemon_a.unix}"),
                *("--instance", f"{second.url}={daemon_b.unix}"),
                *("--model", model),
            )
            client = httpx.Client(timeout=600)
            try:

                def ask(url: str, text: str) -> tuple[float, str]:
                    body = {"model": str(model), "prompt": text, "max_tokens": 1}
                    began = time.perf_counter()
                    reply = client.post(f"{url}/v1/completions", json=body | {"temperature": 0})
                    took = time.perf_counter() - began
                    reply.raise_for_status()
                    return took, reply.headers.get(ROUTED, "")

                def request(n: int) -> str:
                    docs = [_document(rng, args.doc_words) for _ in range(args.k)]
                    return prompts.text(docs, QUESTION.format(n=n, word=rng.choice(WORDS)))

                _progress(f"cold and warm: {args.requests} requests each way, alternating")
                routed = [request(n) for n in range(args.requests)]
                straight = [request(n) for n in range(args.requests, 2 * args.requests)]
                for phase in ("cold", "warm"):
                    times: dict[str, list[float]] = {"router": [], "straight": []}
                    for n, (r, s) in enumerate(zip(routed, straight, strict=True)):
                        pair = [("router", router.url, r), ("straight", first.url, s)]
                        for way, url, text in pair if n % 2 == 0 else pair[::-1]:
                            times[way].append(ask(url, text)[0])
                    yield {**figures, "phase": phase, **_compared(times)}

                _progress(f"placement: {args.requests} requests over the second node's documents")
                docs = [_document(rng, args.doc_words) for _ in range(2 * args.k)]
                for doc in docs:  # stored on the second node: each as its own prompt
                    found = prompts.ingest_prompt(doc)
                    if found is None:
                        raise SystemExit(f"a generated document is not one chunk: {doc!r}")
                    second.complete(found[0])
                times = {"router": [], "straight": []}
                placed = 0
                for n in range(args.requests):
                    chosen = rng.sample(docs, args.k)
                    text = prompts.text(chosen, QUESTION.format(n=n, word=rng.choice(WORDS)))
                    took, went = ask(router.url, text)
                    times["router"].append(took)
                    placed += went == second.url
                    # Straight to the node that stores none of them (another question: not
                    # a prefix-cache hit on what the router's request computed there).
                    other = prompts.text(chosen, QUESTION.format(n=-n, word=rng.choice(WORDS)))
                    times["straight"].append(ask(first.url, other)[0])
                yield {
                    **figures,
                    "phase": "placement",
                    "placed": round(placed / args.requests, 3),
                    **_compared(times),
                }
            finally:
                client.close()
                router.stop()
        finally:
            for daemon, server in nodes:
                server.stop()
                daemon.stop()


def _document(rng: random.Random, words: str) -> str:
    low, _, high = words.partition("-")
    count = rng.randint(int(low), int(high or low))
    return " ".join(rng.choice(WORDS) for _ in range(count)).capitalize() + "."


def _compared(times: dict[str, list[float]]) -> dict[str, Any]:
    router, straight = (statistics.median(times[w]) for w in ("router", "straight"))
    return {
        "router_p50_s": round(router, 4),
        "straight_p50_s": round(straight, 4),
        "router_vs_straight": round(router / straight, 3),
    }


def _progress(what: str) -> None:
    print(f"bench router: {what}", file=sys.stderr, flush=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2", help="model name or folder (smollm2)")
    parser.add_argument(
        "--requests", type=int, default=16, help="requests in each phase, each way (16)"
    )
    parser.add_argument("--k", type=int, default=3, help="documents a request holds (3)")
    parser.add_argument(
        "--doc-words", default="40-160", help="words a document has, a range (40-160)"
    )
    parser.add_argument("--seed", type=int, default=0, help="the documents' and questions' seed")
