"""A real Prometheus (Debian's package) on a free loopback port, scraping given targets with
the project's rule files, for tests."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from chunkstore.processes.redis import free_port

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"
DASHBOARD = DEPLOY.parent / "grafana" / "dashboards" / "chunkstore.json"


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) for every target of the Grafana dashboard."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [(p["title"], t["expr"]) for p in panels for t in p.get("targets", [])]


def concrete(expr: str) -> str:
    """Grafana's variables as an 'All' selection would fill them in."""
    for variable in ("$node", "$instance", "$model_name", "$tenant"):
        expr = expr.replace(variable, ".*")
    return expr.replace("$__rate_interval", "30s")


def about_the_connector(expr: str) -> bool:
    """Panels and rules on vLLM's vllm:chunkstore_* series (scraped from a vLLM server)."""
    return "vllm:" in expr or "connector" in expr


def about_the_router(expr: str) -> bool:
    """Panels on ``chunkstore router``'s series (scraped from a router)."""
    return "chunkstore_router_" in expr


def rule_problem(prometheus: PrometheusServer, rule: dict[str, Any]) -> str | None:
    """Why a loaded rule (from Prometheus's rules API) is not sound, or None. A recording
    rule must record series; an alert must compare one existing signal with a threshold
    and carry a runbook."""
    if rule["health"] != "ok":
        return f"{rule['name']}: {rule.get('lastError')}"
    if rule["type"] == "recording":
        return None if prometheus.query(rule["name"]) else f"{rule['name']} records nothing"
    match = re.fullmatch(r"\s*(\S+)\s*(<|>|<=|>=|==|!=)\s*[0-9.e+-]+\s*", rule["query"])
    if match is None:
        return f"alert {rule['name']} is not 'signal <op> threshold'"
    if not prometheus.query(match.group(1)):
        return f"{rule['name']}: no {match.group(1)}"
    if not rule["annotations"].get("runbook"):
        return f"{rule['name']} has no runbook"
    return None


class PrometheusServer:
    def __init__(
        self,
        workdir: Path,
        targets: list[str],
        interval: str = "1s",
        vllm_targets: list[str] | None = None,
        router_targets: list[str] | None = None,
    ) -> None:
        """``targets``: daemons' metrics addresses; ``vllm_targets``: vLLM servers';
        ``router_targets``: ``chunkstore router``s'."""
        binary = shutil.which("prometheus")
        if binary is None:
            raise FileNotFoundError(
                "prometheus is not installed: apt-get install prometheus (.ci/run does)"
            )
        workdir.mkdir(parents=True, exist_ok=True)
        config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
        config["global"] = {"scrape_interval": interval, "evaluation_interval": interval}
        config["rule_files"] = [str(DEPLOY / f) for f in config["rule_files"]]
        config["scrape_configs"] = [
            {"job_name": "chunkstore", "static_configs": [{"targets": targets}]},
            {"job_name": "vllm", "static_configs": [{"targets": vllm_targets or []}]},
            {
                "job_name": "chunkstore-router",
                "static_configs": [{"targets": router_targets or []}],
            },
        ]
        self.config_file = workdir / "prometheus.yml"
        self.config_file.write_text(yaml.safe_dump(config))
        self.port = free_port()
        self.log = (workdir / "prometheus.log").open("w")
        self.process = subprocess.Popen(
            [
                binary,
                f"--config.file={self.config_file}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{self.url}/-/ready", timeout=1).read()
                return
            except OSError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    self.stop()
                    raise RuntimeError(
                        f"prometheus did not start: {(workdir / 'prometheus.log').read_text()}"
                    ) from None
                time.sleep(0.2)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def api(self, path: str, **params: Any) -> Any:
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=10) as r:
            body = json.loads(r.read())
        if body.get("status") != "success":
            raise RuntimeError(f"{path} {params}: {body}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        return list(self.api("query", query=expr)["result"])

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=30)
        self.log.close()

    def __enter__(self) -> PrometheusServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
