"""The router's Prometheus metrics, in a registry of its own (served on ``/metrics``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


# attribute, name, help, labels: one Counter each
COUNTERS: tuple[tuple[str, str, str, tuple[str, ...]], ...] = (
    (
        "requests",
        "chunkstore_router_requests",
        "Requests answered, by endpoint and HTTP status.",
        ("endpoint", "status"),
    ),
    (
        "routed",
        "chunkstore_router_routed",
        "Requests sent to an instance, by instance and reason (only, stored, load).",
        ("instance", "reason"),
    ),
    (
        "cold_sent",
        "chunkstore_router_cold_chunks_sent",
        "Missing chunks (and sys segments) sent to an instance as their own prefill.",
        (),
    ),
    (
        "cold_joined",
        "chunkstore_router_cold_chunks_joined",
        "Missing chunks a request waited for that another request was already sending.",
        (),
    ),
    (
        "cold_failed",
        "chunkstore_router_cold_chunks_failed",
        "Missing chunks whose prefill failed, or that were sent and not stored under the "
        "keys the router computed (its settings differ from the connector's), or past the "
        "client's share (client_share): the request computes them itself.",
        ("why",),
    ),
    (
        "rerouted",
        "chunkstore_router_rerouted",
        "Requests moved to another instance because this one was gone (refused the "
        "connection, broke off before answering, or answered 5xx and failed a health "
        "check).",
        ("instance",),
    ),
    (
        "fallbacks",
        "chunkstore_router_fallbacks",
        "Requests passed on without the store's help, by why: unparsed, tokenize_failed, "
        "daemon_unreachable, daemon_skipped (it failed within --daemon-retry), "
        "too_many_prompts, too_many_chunks, refused_fields (fields the instance "
        "refuses), unknown_model, too_long (over the model's context).",
        ("why",),
    ),
    (
        "reordered",
        "chunkstore_router_reordered",
        "Requests sent with their relevant documents last (the default's answers on a "
        "back end without the in-band hook), by shape: completion, chat.",
        ("shape",),
    ),
    (
        "order_kept",
        "chunkstore_router_order_kept",
        "Requests whose relevant documents were not put last though they would have "
        "been, by why: chat_text (its messages, rewritten, did not tokenize to the "
        "reordered prompt, or no single message held every separator).",
        ("why",),
    ),
    (
        "tokenized",
        "chunkstore_router_prompts_tokenized",
        "Prompts given token IDs, by where: router (its --model tokenizer, for an "
        "instance proven to tokenize alike), instance (its /tokenize: a chat, or an "
        "instance not proven).",
        ("by",),
    ),
    (
        "tokenizer_checks",
        "chunkstore_router_tokenizer_checks",
        "Texts tokenized by both the router and the instance, to compare (one in 64 "
        "of those the router tokenizes).",
        (),
    ),
    (
        "tokenizer_proofs",
        "chunkstore_router_tokenizer_proofs",
        "Instances' tokenizers asked the probe set (at start-up, after the instance was "
        "down, after a text differed), by result: identical (the router sends its own "
        "IDs there), differs (never), unanswered (asked again).",
        ("result",),
    ),
    (
        "tokenizer_mismatch",
        "chunkstore_router_tokenizer_mismatch",
        "Texts the instance tokenized otherwise than the router's --model tokenizer: that "
        "instance tokenizes every prompt until its tokenizer is proven again.",
        (),
    ),
)


class RouterMetrics:
    requests: Counter
    routed: Counter
    cold_sent: Counter
    cold_joined: Counter
    cold_failed: Counter
    rerouted: Counter
    fallbacks: Counter
    reordered: Counter
    order_kept: Counter
    tokenized: Counter
    tokenizer_checks: Counter
    tokenizer_proofs: Counter
    tokenizer_mismatch: Counter

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        for attr, name, doc, labels in COUNTERS:
            setattr(self, attr, Counter(name, doc, labels, registry=r))
        self.upstream = Histogram(
            "chunkstore_router_upstream_seconds",
            "Time an instance took: warm (a request's missing chunks), request (until its "
            "reply's headers), tokenize.",
            ["phase"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self._zero_every_label()

    def _zero_every_label(self) -> None:
        """Every reason a series from the start (at 0), so that dashboards and alerts see a
        zero, not an absence, until the first one."""
        for why in COLD_FAILED:
            self.cold_failed.labels(why)
        for why in FALLBACKS:
            self.fallbacks.labels(why)
        for shape in ("completion", "chat"):
            self.reordered.labels(shape)
        self.order_kept.labels("chat_text")
        for by in ("router", "instance"):
            self.tokenized.labels(by)
        for result in ("identical", "differs", "unanswered"):
            self.tokenizer_proofs.labels(result)


COLD_FAILED = ("prefill_error", "not_stored", "client_share")
FALLBACKS = (
    "unparsed",
    "tokenize_failed",
    "daemon_unreachable",
    "daemon_skipped",
    "too_many_prompts",
    "too_many_chunks",
    "refused_fields",
    "unknown_model",
    "too_long",
)
