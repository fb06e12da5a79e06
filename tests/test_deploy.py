"""The deploy files, proven: a real Prometheus scrapes a real daemon with the project's rules,
and every dashboard query and rule evaluates and returns series; the hit rate it computes is
the hit rate the test made, overall and per tenant; a tenants file that fails to reload fires
its alert. Manifests and the systemd unit pass their validators."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from chunkstore.client import ChunkStoreClient
from chunkstore.daemon.tenants import hash_token
from chunkstore.errors import InvalidRequest
from chunkstore.processes.daemon import start_daemon
from chunkstore.testing.prometheus import (
    DASHBOARD,
    DEPLOY,
    PrometheusServer,
    about_the_connector,
    about_the_router,
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
# serve --tenants: the shared namespace's client holds the admin token (it evicts); alice, a
# tenant with a quota, makes the same traffic in her own namespace, so both hit rates are 0.6.
ADMIN_TOKEN, ALICE_TOKEN = "deploy-admin-token", "deploy-alice-token"
ALICE_QUOTA = 512 << 10


@pytest.fixture(scope="module")
def scraped(tmp_path_factory):
    """A daemon under known traffic, scraped every second by Prometheus with our rules."""
    workdir = tmp_path_factory.mktemp("deploy")
    tenants = workdir / "tenants.toml"
    tenants.write_text(
        "[tenants.alice]\n"
        f'token_sha256 = "{hash_token(ALICE_TOKEN)}"\n'
        f'quota = "{ALICE_QUOTA >> 10}K"\n'
        'reserved = "0"\n'
        "shared = true\n"
    )
    daemon = start_daemon(
        workdir / "daemon",
        "--node",
        "node-a",
        "--disk-dir",
        str(workdir / "disk"),
        "--admin-token",
        ADMIN_TOKEN,
        "--tenants",
        str(tenants),
        pool_bytes=1 << 20,
    )
    prometheus = PrometheusServer(workdir / "prometheus", [daemon.ready["metrics"]])
    began = time.time()
    try:
        with (
            ChunkStoreClient(daemon.unix, token=ADMIN_TOKEN) as client,
            ChunkStoreClient(daemon.unix, token=ALICE_TOKEN) as alice,
        ):
            keys = [i.to_bytes(16, "little") for i in range(len(TOKENS))]
            for key, tokens in zip(keys[:PRESENT], TOKENS, strict=False):
                kv = torch.zeros(1, tokens, 1, 8)
                client.put(key, kv, kv, 0)
                alice.put(key, kv, kv, 0)  # her namespace: the same keys, other entries
            # One reload of a file that does not load: alice's tenancy stays in force. After a
            # scrape that saw no failure, or increase() has nothing to count from.
            failed = 'chunkstore_tenant_reloads_total{result="failed"}'
            deadline = time.monotonic() + 30
            while not prometheus.query(failed):
                assert time.monotonic() < deadline, "prometheus never scraped the daemon"
                time.sleep(0.2)
            tenants.write_text('[tenants.alice]\ntoken_sha256 = "not hex"\n')
            daemon.process.send_signal(signal.SIGHUP)
            with pytest.raises(InvalidRequest):
                client.lookup([b"bad"])  # one error, so the errors series exists
            client.evict([keys[0]])  # one admin eviction, then put it back
            client.put(keys[0], torch.zeros(1, TOKENS[0], 1, 8), torch.zeros(1, 10, 1, 8), 0)
            deadline = time.monotonic() + 8
            while time.monotonic() < deadline:  # traffic at a constant hit ratio
                assert client.lookup(keys, num_tokens=TOKENS)[PRESENT:] == [None]
                assert alice.lookup(keys, num_tokens=TOKENS)[PRESENT:] == [None]
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
        if not (about_the_connector(expr) or about_the_router(expr)):  # their own tests
            assert result, f"panel {title!r}: {expr} returned no series"


def test_tenant_panels_show_the_tenants_selected(scraped) -> None:
    prometheus, _, _ = scraped
    by_tenant = [(t, e) for t, e in dashboard_queries() if "$tenant" in e]
    assert len(by_tenant) >= 4
    for title, expr in by_tenant:
        every = {s["metric"]["tenant"] for s in prometheus.query(concrete(expr))}
        assert "alice" in every, f"panel {title!r}: {expr} shows {every}"
        alice = prometheus.query(concrete(expr.replace("$tenant", "alice")))
        assert {s["metric"]["tenant"] for s in alice} == {"alice"}, (title, expr)


def test_template_variables_resolve(scraped) -> None:
    prometheus, _, _ = scraped
    variables = json.loads(DASHBOARD.read_text())["templating"]["list"]
    node = next(v for v in variables if v["name"] == "node")
    metric = re.search(r"label_values\((\w+), node\)", node["definition"])
    assert metric is not None
    assert prometheus.api("label/node/values", **{"match[]": metric.group(1)}) == ["node-a"]
    tenant = next(v for v in variables if v["name"] == "tenant")
    metric = re.search(r"label_values\((\w+), tenant\)", tenant["definition"])
    assert metric is not None
    values = prometheus.api("label/tenant/values", **{"match[]": metric.group(1)})
    assert values == ["alice", "shared"]


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
        ('tenant:chunkstore_hit_rate_tokens:ratio_rate5m{tenant="alice"}', TOKEN_HIT_RATE),
        ('tenant:chunkstore_hit_rate_tokens:ratio_rate5m{tenant="shared"}', TOKEN_HIT_RATE),
        (
            'sum(chunkstore_tenant_lookup_tokens_total{tenant="alice"})',
            made.tenants["alice"].lookup_tokens,
        ),
        ('sum(chunkstore_tenant_quota_bytes{tenant="alice"})', ALICE_QUOTA),
    ]:
        [sample] = prometheus.query(expr)
        assert float(sample["value"][1]) == pytest.approx(expected, rel=1e-9), expr


def test_hit_rate_picture_renders_from_scraped_data(scraped, tmp_path: Path) -> None:
    """The hit-rate panels drawn from what Prometheus scraped here (docs/operations.md, "What
    is checked"). Set CHUNKSTORE_DOCS_DIR to write the picture there as well."""
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


def test_a_tenants_file_that_does_not_reload_fires_its_alert(scraped) -> None:
    prometheus, _, _ = scraped
    [failed] = prometheus.query('chunkstore_tenant_reloads_total{result="failed"}')
    assert float(failed["value"][1]) == 1
    [signal_] = prometheus.query("node:chunkstore_tenant_reload_failures:increase10m")
    assert signal_["metric"]["node"] == "node-a" and float(signal_["value"][1]) > 0
    deadline = time.monotonic() + 15
    while True:
        firing = [
            a
            for a in prometheus.api("alerts")["alerts"]
            if a["labels"]["alertname"] == "ChunkstoreTenantsReloadFailed"
            and a["state"] == "firing"
        ]
        if firing or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert [a["labels"]["node"] for a in firing] == ["node-a"]
    assert "previous tenants stay in force" in firing[0]["annotations"]["summary"]


def test_the_image_builder_parses_and_every_dockerfile_takes_its_pip_settings() -> None:
    """`make images` (docker/build-images.sh; built before a release, not in CI) passes pip
    its wheels, trusted host and constraints as build arguments: each Dockerfile's stage
    that runs pip declares them, or the build reaches PyPI alone (here: the CUDA torch)."""
    script = ROOT / "docker" / "build-images.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    passed = set(re.findall(r"--build-arg \"?(PIP_[A-Z_]+)=", script.read_text()))
    assert passed == {"PIP_FIND_LINKS", "PIP_TRUSTED_HOST", "PIP_CONSTRAINT"}
    for dockerfile in sorted((ROOT / "docker").glob("Dockerfile.*")):
        stages = re.split(r"^FROM ", dockerfile.read_text(), flags=re.M)[1:]
        for stage in stages:
            if "pip " in stage:
                declared = set(re.findall(r"\b(PIP_[A-Z_]+)=", stage.split("RUN")[0]))
                assert passed <= declared, (dockerfile.name, passed - declared)
