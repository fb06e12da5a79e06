"""The deploy files, proven: a real Prometheus scrapes a real daemon with the project's rules,
and every dashboard query and rule evaluates and returns series; the hit rate it computes is
the hit rate the test made. Manifests and the systemd unit pass their validators."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from chunkstore.client import ChunkStoreClient
from chunkstore.errors import InvalidRequest
from chunkstore.processes.daemon import start_daemon
from chunkstore.testing.prometheus import (
    DASHBOARD,
    DEPLOY,
    PrometheusServer,
    about_the_connector,
    concrete,
    dashboard_queries,
    rule_problem,
)

ROOT = Path(__file__).resolve().parents[1]
RULE_FILES = sorted((DEPLOY / "rules").glob("*.yml"))
# Every lookup the test makes: 4 keys of 10, 20, 30, 40 tokens, the first three present.
TOKENS, PRESENT = [10, 20, 30, 40], 3
TOKEN_HIT_RATE = sum(TOKENS[:PRESENT]) / sum(TOKENS)  # 0.6
CHUNK_HIT_RATE = PRESENT / len(TOKENS)  # 0.75


@pytest.fixture(scope="module")
def scraped(tmp_path_factory):
    """A daemon under known traffic, scraped every second by Prometheus with our rules."""
    workdir = tmp_path_factory.mktemp("deploy")
    daemon = start_daemon(
        workdir / "daemon",
        "--node",
        "node-a",
        "--disk-dir",
        str(workdir / "disk"),
        pool_bytes=1 << 20,
    )
    prometheus = PrometheusServer(workdir / "prometheus", [daemon.ready["metrics"]])
    began = time.time()
    try:
        with ChunkStoreClient(daemon.unix) as client:
            keys = [i.to_bytes(16, "little") for i in range(len(TOKENS))]
            for key, tokens in zip(keys[:PRESENT], TOKENS, strict=False):
                kv = torch.zeros(1, tokens, 1, 8)
                client.put(key, kv, kv, 0)
            with pytest.raises(InvalidRequest):
                client.lookup([b"bad"])  # one error, so the errors series exists
            client.evict([keys[0]])  # one admin eviction, then put it back
            client.put(keys[0], torch.zeros(1, TOKENS[0], 1, 8), torch.zeros(1, 10, 1, 8), 0)
            deadline = time.monotonic() + 8
            while time.monotonic() < deadline:  # traffic at a constant hit ratio
                assert client.lookup(keys, num_tokens=TOKENS)[PRESENT:] == [None]
                client.get(keys[1])
                time.sleep(0.05)
            made = client.stats()
        time.sleep(3)  # two more scrapes and rule evaluations after the last request
        yield prometheus, made, began
    finally:
        prometheus.stop()
        assert daemon.stop() == 0, daemon.log()


def test_every_dashboard_query_evaluates_and_returns_series(scraped) -> None:
    prometheus, _, _ = scraped
    queries = dashboard_queries()
    assert len(queries) >= 15
    for title, expr in queries:
        result = prometheus.query(concrete(expr))  # raises if it does not evaluate
        if not about_the_connector(expr):
            assert result, f"panel {title!r}: {expr} returned no series"


def test_template_variables_resolve(scraped) -> None:
    prometheus, _, _ = scraped
    variables = json.loads(DASHBOARD.read_text())["templating"]["list"]
    node = next(v for v in variables if v["name"] == "node")
    metric = re.search(r"label_values\((\w+), node\)", node["definition"])
    assert metric is not None
    assert prometheus.api("label/node/values", **{"match[]": metric.group(1)}) == ["node-a"]


def test_every_rule_evaluates_and_returns_series(scraped) -> None:
    prometheus, _, _ = scraped
    groups = prometheus.api("rules")["groups"]
    rules = [r for g in groups for r in g["rules"]]
    defined = [
        r for f in RULE_FILES for g in yaml.safe_load(f.read_text())["groups"] for r in g["rules"]
    ]
    assert len(rules) == len(defined) >= 14
    for rule in rules:
        assert rule["health"] == "ok", f"{rule['name']}: {rule.get('lastError')}"
        if not about_the_connector(rule["query"]):
            assert rule_problem(prometheus, rule) is None, rule_problem(prometheus, rule)


def test_the_hit_rate_prometheus_computes_is_the_hit_rate_made(scraped) -> None:
    prometheus, made, _ = scraped
    assert made.lookup_tokens and made.hit_tokens / made.lookup_tokens == pytest.approx(
        TOKEN_HIT_RATE, abs=1e-12
    )
    for expr, expected in [
        ("cluster:chunkstore_hit_rate_tokens:ratio_rate5m", TOKEN_HIT_RATE),
        ("cluster:chunkstore_hit_rate_chunks:ratio_rate5m", CHUNK_HIT_RATE),
        ('node:chunkstore_hit_rate_tokens:ratio_rate5m{node="node-a"}', TOKEN_HIT_RATE),
        (
            "sum(chunkstore_hit_tokens_total) / sum(chunkstore_lookup_tokens_total)",
            made.hit_tokens / made.lookup_tokens,
        ),
        ("sum(chunkstore_lookup_chunks_total)", made.lookups),
        ("sum(chunkstore_hit_chunks_total)", made.hits),
    ]:
        [sample] = prometheus.query(expr)
        assert float(sample["value"][1]) == pytest.approx(expected, rel=1e-9), expr


def test_hit_rate_picture_renders_from_scraped_data(scraped, tmp_path: Path) -> None:
    """The picture in docs/operations.md ("What is checked"): the hit-rate panels drawn from
    what Prometheus scraped here. Set CHUNKSTORE_DOCS_DIR to write it there as well."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    prometheus, _, began = scraped
    panels = {p["title"]: p for p in json.loads(DASHBOARD.read_text())["panels"]}
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.2))
    for ax, title in zip(
        axes, ["Hit rate by node, tokens", "Hit rate by node, chunks"], strict=True
    ):
        expr = concrete(panels[title]["targets"][0]["expr"]).replace("30s", "3s")
        data = prometheus.api("query_range", query=expr, start=began, end=time.time(), step="1")[
            "result"
        ]
        assert data, title
        for series in data:
            t0 = float(series["values"][0][0])
            xs = [float(t) - t0 for t, _ in series["values"]]
            ys = [float(v) for _, v in series["values"]]
            ax.plot(xs, ys, label=series["metric"].get("node", "all"))
        ax.set_title(title)
        ax.set_ylim(0, 1.05)
        ax.set_xlabel("seconds")
        ax.yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
        ax.legend(loc="lower right")
    fig.suptitle("chunkstore hit rate, scraped by Prometheus in tests/test_deploy.py")
    fig.tight_layout()
    out = tmp_path / "hit-rate.png"
    fig.savefig(out, dpi=90)
    assert out.stat().st_size > 5000
    if os.environ.get("CHUNKSTORE_DOCS_DIR"):
        shutil.copy(out, Path(os.environ["CHUNKSTORE_DOCS_DIR"]) / "hit-rate.png")


def test_promtool_accepts_the_config_and_the_rules() -> None:
    subprocess.run(
        ["promtool", "check", "config", str(DEPLOY / "prometheus.yml")],
        check=True,
        capture_output=True,
    )
    subprocess.run(
        ["promtool", "check", "rules", *map(str, RULE_FILES)], check=True, capture_output=True
    )


def test_kubernetes_manifests_validate_against_the_schemas() -> None:
    manifests = sorted((ROOT / "deploy" / "k8s").glob("*.yaml"))
    assert len(manifests) >= 5
    run = subprocess.run(
        [
            str(Path(sys.executable).parent / "kubernetes-validate"),
            "--strict",
            "--quiet",
            *map(str, manifests),
        ],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout + run.stderr


def test_systemd_unit_verifies(tmp_path: Path) -> None:
    unit = (ROOT / "deploy" / "systemd" / "chunkstore.service").read_text()
    # systemd-analyze checks that ExecStart exists: point it at this checkout's install.
    local = unit.replace(
        "/opt/chunkstore/.venv/bin/chunkstore", str(Path(sys.executable).parent / "chunkstore")
    )
    (tmp_path / "chunkstore.service").write_text(local)
    run = subprocess.run(
        ["systemd-analyze", "verify", str(tmp_path / "chunkstore.service")],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout + run.stderr
