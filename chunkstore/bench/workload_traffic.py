"""``bench workload``'s traffic: the trace's requests sent through the stock ``openai``
client as the trace times them (``send``: TTFT, TPOT, throughput), and what the servers
counted, read off their ``/metrics`` (``scrape``: vLLM's prompt hit rate, the router's
work)."""

from __future__ import annotations

import statistics
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from chunkstore.bench.workload_trace import Trace

if TYPE_CHECKING:
    from chunkstore.processes.router import RunningRouter


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def send(url: str, model: str, trace: Trace, prompts: list[str], args: Any) -> dict[str, Any]:
    """Every request through the OpenAI client, as the trace times them (or ``concurrency``
    at once); per request the wall time of its first and last token."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=600)
    rows: list[dict[str, float]] = []
    lock = threading.Lock()

    def one(index: int, prompt: str) -> None:
        sent = time.perf_counter()
        first, tokens = None, 0
        stream = client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=args.output_tokens,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
            # Every way generates the same number of tokens, whatever its KV makes of them.
            extra_body={"ignore_eos": True},
        )
        for chunk in stream:
            if chunk.choices and chunk.choices[0].text and first is None:
                first = time.perf_counter()
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        done = time.perf_counter()
        with lock:
            rows.append(
                {"i": index, "sent": sent, "first": first or done, "done": done, "tokens": tokens}
            )

    began = time.perf_counter()
    workers = args.concurrency or 64
    with ThreadPoolExecutor(workers) as pool:
        futures = []
        for index, (request, prompt) in enumerate(zip(trace.requests, prompts, strict=True)):
            if not args.concurrency:  # Poisson: wait for the request's arrival
                time.sleep(max(0.0, began + request.at - time.perf_counter()))
            futures.append(pool.submit(one, index, prompt))
        for future in futures:
            future.result()
    rows.sort(key=lambda r: r["i"])  # trace order
    ttfts = [r["first"] - r["sent"] for r in rows]
    # Past the cold start (the first fifth of the trace, when little is stored yet).
    warm = [t for r, t in zip(rows, ttfts, strict=True) if r["i"] >= len(rows) // 5]
    tpots = [(r["done"] - r["first"]) / (r["tokens"] - 1) for r in rows if r["tokens"] > 1]
    # A request's whole time, its first token and its decodes: a way that spends fewer
    # steps on the prompt and more in the decodes beside others' prefills shows it here.
    latencies = [r["done"] - r["sent"] for r in rows]
    span = max(r["done"] for r in rows) - min(r["sent"] for r in rows)
    return {
        "ttft_p50_s": round(percentile(ttfts, 0.5), 4),
        "ttft_p90_s": round(percentile(ttfts, 0.9), 4),
        "ttft_p99_s": round(percentile(ttfts, 0.99), 4),
        "ttft_p50_warm_s": round(percentile(warm, 0.5), 4),
        "ttft_p99_warm_s": round(percentile(warm, 0.99), 4),
        "tpot_s": round(statistics.median(tpots), 4) if tpots else None,
        "latency_p50_s": round(percentile(latencies, 0.5), 4),
        "latency_p99_s": round(percentile(latencies, 0.99), 4),
        "throughput_rps": round(len(rows) / span, 4),
        "completion_tokens_min": min(int(r["tokens"]) for r in rows),
        "ttfts_s": [round(t, 4) for t in ttfts],
    }


def scrape(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = out.get(name, 0.0) + float(value)
    return out


def summed(scraped: dict[str, float], prefix: str) -> float:
    return sum(v for k, v in scraped.items() if k.partition("{")[0] == prefix)


def prompt_hit_rate(scraped: dict[str, float]) -> float | None:
    """Prompt tokens vLLM did not compute (its prefix cache's hits, and what chunkstore
    supplied beyond them) over all prompt tokens, from its /metrics."""
    prompt = summed(scraped, "vllm:prompt_tokens_total")
    saved = summed(scraped, "vllm:prefix_cache_hits_total")
    saved += summed(scraped, "vllm:chunkstore_hit_tokens_total")
    return round(saved / prompt, 4) if prompt else None


def router_figures(router: RunningRouter) -> dict[str, float]:
    """What the router did for the trace: requests it reordered (relevant documents last),
    cold chunks it sent as their own prompts, requests it passed on without its work."""
    scraped = scrape(router.url)
    return {
        "reordered": summed(scraped, "chunkstore_router_reordered_total"),
        "cold_chunks_sent": summed(scraped, "chunkstore_router_cold_chunks_sent_total"),
        "cold_chunks_failed": summed(scraped, "chunkstore_router_cold_chunks_failed_total"),
        **failed_by_why(scraped),
        "fallbacks": summed(scraped, "chunkstore_router_fallbacks_total"),
    }


def failed_by_why(scraped: dict[str, float]) -> dict[str, float]:
    """Cold chunks the router sent and its request did not find, by why: ``prefill_error``,
    ``not_stored`` (gone before its request looked: a full or evicting pool), ``client_share``."""
    found = {}
    prefix = 'chunkstore_router_cold_chunks_failed_total{why="'
    for name, value in scraped.items():
        if name.startswith(prefix) and value:
            why = name.removeprefix(prefix).split('"')[0]
            found[f"cold_chunks_failed_{why}"] = value
    return found
