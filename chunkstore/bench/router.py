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
  computes every prompt whole); the two alternate, each pair of the same shape (documents
  of the same word counts). ``router_vs_straight`` is the router's median over going
  straight's (below 1: the router is faster).
- ``warm``: right after each cold pair, the router's request again, and straight to the
  instance it went to the token IDs the router sent there (its relevant order; sent once
  before, untimed): the same tokens computed both ways past vLLM's prefix cache, so what is
  left is what the router adds (the issue's bound is 1.05). ``router_vs_text``: against the
  text as written, straight to that instance: there its relevant documents load isolated
  where they stand (the isolated answers), where the router has vLLM compute them last (the
  default's): up to a vLLM block of each more to compute, warm.
- ``placement``: ``--requests`` requests over documents stored on the second instance only
  (its daemon), through the router: the share it sends there (``placed``), and their median
  against the same requests straight to the first instance, which holds none of them.
``--instance`` (twice) measures two running instances instead of starting them.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from chunkstore.kv.keyspace import KeySpace
from chunkstore.models import WORDS, resolve
from chunkstore.policy.treatment import QualityConfig
from chunkstore.router import order
from chunkstore.router.tokens import TOKENIZE, Tokenizer

SYS = "Answer the question from the documents."
QUESTION = "Question {n}: what do these documents say about {word}?"
ROUTED = "x-chunkstore-instance"  # the instance a request went to (operators: loopback here)


def run(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    model = resolve(args.model)
    with contextlib.ExitStack() as stack:
        if args.instance:
            if len(args.instance) != 2:
                raise SystemExit("--instance: give two, URL=DAEMON_SOCKET each")
            nodes = [_node_of(given) for given in args.instance]
        else:
            nodes = _started(stack, model)
        yield from _measured(args, model, nodes, stack)


def _node_of(given: str) -> tuple[str, str]:
    from chunkstore.router.instances import parse_instance

    try:
        instance = parse_instance(given, "")
    except ValueError as err:
        raise SystemExit(f"--instance: {err}") from None
    if not instance.daemon:
        raise SystemExit(f"--instance {given!r}: URL=DAEMON_SOCKET (the daemon's address too)")
    return instance.url.rstrip("/"), instance.daemon


def _started(stack: contextlib.ExitStack, model: Path) -> list[tuple[str, str]]:
    """Two instances (the hook off), each on its own daemon, one Redis directory."""
    from chunkstore.processes.daemon import start_daemon
    from chunkstore.processes.redis import RedisServer
    from chunkstore.processes.vllm_server import VllmServer

    work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="chunkstore-router-")))
    redis = stack.enter_context(RedisServer(work / "redis"))
    _progress("two instances, each on its own daemon, one Redis directory")

    def node(name: str) -> tuple[str, str]:
        cluster = ("--redis", redis.url, "--node", name)
        daemon = start_daemon(work / f"{name}-daemon", *cluster, pool_bytes=256 << 20)
        stack.callback(daemon.stop)
        settings = {"address": daemon.unix, "inband_isolation": False}
        server = VllmServer(model, work / f"{name}-vllm", settings)
        stack.callback(server.stop)
        return server.url, daemon.unix

    with ThreadPoolExecutor(2) as starting:
        return list(starting.map(node, ("node-a", "node-b")))


def _measured(
    args: argparse.Namespace,
    model: Path,
    nodes: list[tuple[str, str]],
    stack: contextlib.ExitStack,
) -> Iterator[dict[str, Any]]:
    import httpx

    from chunkstore.processes.router import RunningRouter
    from chunkstore.prompts import RagPrompts

    (first, daemon_a), (second, daemon_b) = nodes
    prompts = RagPrompts.for_model(model, SYS)
    rng = random.Random(args.seed)
    figures = {
        "bench": "router",
        "model": args.model,
        "requests": args.requests,
        "k": args.k,
        "tokenize": args.tokenize,
    }
    work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="chunkstore-router-")))
    router = RunningRouter(
        work / "router",
        *("--instance", f"{first}={daemon_a}", "--instance", f"{second}={daemon_b}"),
        *("--model", model, "--tokenize", args.tokenize),
    )
    stack.callback(router.stop)
    client = stack.enter_context(httpx.Client(timeout=600))
    traffic = _Traffic(args, model, client, prompts, rng)
    for phase, times in _cold_and_warm(traffic, router.url, first).items():
        yield {**figures, "phase": phase, **_compared(times)}
    placed, times = _placement(traffic, router.url, first, second)
    yield {**figures, "phase": "placement", "placed": placed, **_compared(times)}


class _Traffic:
    """The bench's requests: seeded documents and questions, sent one at a time and timed."""

    def __init__(
        self, args: argparse.Namespace, model: Path, client: Any, prompts: Any, rng: random.Random
    ) -> None:
        self.args, self.model, self.client = args, model, client
        self.prompts, self.rng = prompts, rng
        self.tokenizer = Tokenizer.for_model(model)  # the router's defaults: what it sends
        self.keys = KeySpace.for_model(model, "float32", tokenizer=self.tokenizer.tokenizer)

    def ask(self, url: str, prompt: str | list[int]) -> tuple[float, str]:
        """A one-token completion: its latency, and the instance the router says it chose."""
        body = {"model": str(self.model), "prompt": prompt, "max_tokens": 1, "temperature": 0}
        began = time.perf_counter()
        reply = self.client.post(f"{url}/v1/completions", json=body)
        took = time.perf_counter() - began
        reply.raise_for_status()
        return took, reply.headers.get(ROUTED, "")

    def request(self, n: int, docs: list[str]) -> str:
        return self.prompts.text(docs, QUESTION.format(n=n, word=self.rng.choice(WORDS)))

    def same_shape(self, n: int) -> tuple[str, str]:
        """Two requests of the same shape (documents of the same word counts, the same
        question), each over documents of its own."""
        rng = self.rng
        counts = [_words(rng, self.args.doc_words) for _ in range(self.args.k)]
        word = rng.choice(WORDS)
        texts = [[_document(rng, c) for c in counts] for _ in range(2)]
        one, other = (self.prompts.text(t, QUESTION.format(n=n, word=word)) for t in texts)
        return one, other

    def as_sent(self, text: str) -> list[int]:
        """The token IDs the router sends for ``text`` (its relevant order)."""
        return order.sent_ids(self.keys, QualityConfig(), self.tokenizer.ids({"prompt": text}))


def _cold_and_warm(traffic: _Traffic, router: str, first: str) -> dict[str, dict[str, list[float]]]:
    """Cold pairs of the same shape, through the router and straight to the first instance,
    alternating; each followed by its warm requests. The latencies, by phase and way."""
    requests = traffic.args.requests
    _progress(f"cold and warm: {requests} requests each way, alternating")
    phases: dict[str, dict[str, list[float]]] = {
        "cold": {"router": [], "straight": []},
        "warm": {"router": [], "straight": [], "text": []},
    }
    for n in range(requests):
        r, s = traffic.same_shape(n)
        went = first
        cold = [("router", router, r), ("straight", first, s)]
        for way, url, prompt in cold if n % 2 == 0 else cold[::-1]:
            took, at = traffic.ask(url, prompt)
            phases["cold"][way].append(took)
            if way == "router":
                went = at or first  # the instance it chose (its header, for operators)
        # Warm, right after (still in vLLM's 1 GiB prefix cache whatever --requests): the
        # router's request again; straight to the instance it went to, the token IDs the
        # router sent there (the same tokens computed both ways: what is left is what the
        # router adds); and the text as written, straight there (its relevant documents
        # loaded isolated where they stand: what computing them last costs a warm
        # request). Each straight prompt sent once before, untimed.
        sent = traffic.as_sent(r)
        traffic.ask(went, sent)
        traffic.ask(went, r)
        warm: list[tuple[str, str, str | list[int]]] = [
            ("router", router, r),
            ("straight", went, sent),
            ("text", went, r),
        ]
        for way, url, again in warm if n % 2 == 0 else warm[::-1]:
            phases["warm"][way].append(traffic.ask(url, again)[0])
    return phases


def _placement(
    traffic: _Traffic, router: str, first: str, second: str
) -> tuple[float, dict[str, list[float]]]:
    """Requests over documents stored through the second instance only, through the router
    and straight to the first: the share the router sent to the second, and the latencies."""
    args, rng = traffic.args, traffic.rng
    _progress(f"placement: {args.requests} requests over the second instance's documents")
    docs = [_document(rng, _words(rng, args.doc_words)) for _ in range(2 * args.k)]
    for doc in docs:  # stored through the second instance: each as its own prompt
        found = traffic.prompts.ingest_prompt(doc)
        if found is None:
            raise SystemExit(f"a generated document is not one chunk: {doc!r}")
        traffic.ask(second, found[0])
    times: dict[str, list[float]] = {"router": [], "straight": []}
    placed = 0
    chosen = [rng.sample(docs, args.k) for _ in range(args.requests)]
    for n, picked in enumerate(chosen):
        took, went = traffic.ask(router, traffic.request(n, picked))
        times["router"].append(took)
        placed += went == second
    # Then straight to the instance whose daemon stores none of them (other questions: no
    # prefix-cache hit on what the router's requests computed). After the routed ones: its
    # connector pulls what it lacks from the second's daemon (the Redis directory), and
    # would then hold the documents too.
    for n, picked in enumerate(chosen):
        times["straight"].append(traffic.ask(first, traffic.request(-n - 1, picked))[0])
    return round(placed / args.requests, 3), times


def _words(rng: random.Random, words: str) -> int:
    low, _, high = words.partition("-")
    return rng.randint(int(low), int(high or low))


def _document(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count)).capitalize() + "."


def _compared(times: dict[str, list[float]]) -> dict[str, Any]:
    router, straight = (statistics.median(times[w]) for w in ("router", "straight"))
    found = {
        "router_p50_s": round(router, 4),
        "straight_p50_s": round(straight, 4),
        "router_vs_straight": round(router / straight, 3),
    }
    if times.get("text"):
        text = statistics.median(times["text"])
        found |= {"text_p50_s": round(text, 4), "router_vs_text": round(router / text, 3)}
    return found


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
    parser.add_argument(
        "--tokenize",
        choices=TOKENIZE,
        default="router",
        help="the router's --tokenize: router (its default: texts tokenized in the router once "
        "the instance agreed) or instance (a /tokenize round trip a request)",
    )
    parser.add_argument(
        "--instance",
        action="append",
        help="URL=DAEMON_SOCKET of a running instance (the connector's daemon address), twice: "
        "measure those two, their daemons sharing a Redis directory, instead of starting "
        "two (requests going straight go to the first; placement's documents are stored "
        "through the second)",
    )
