"""One settings object: the connector's ``kv_connector_extra_config``, given once to
`chunkstore up` (``--connector-config``), is what every vLLM instance's connector and the
router run by, so the router orders each request by the connector's own policy.

Shown on the quality bench's prompt set (``bench.qa_cases``, its 8 documents a case) with a
non-default ``relevant_last`` and ``relevant_min_score`` and the hook off (as on CUDA or
Ascend: the router sends the relevant documents last, the connector leaves them to vLLM):
on every request, the tokens the router counts as loaded (the pieces before the documents
it put last, every one stored: its ``x-chunkstore-stored-tokens``) are the tokens the
connector loaded (vLLM's ``cached_tokens``). A router on its defaults (3, 0.5) in front of
the same instance expects other than the connector, deciding by (2, 0.9), loads."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from chunkstore.bench import qa_cases
from chunkstore.processes.router import RunningRouter
from chunkstore.processes.vllm_server import stop_group
from chunkstore.prompts import RagPrompts

SETTINGS = {"inband_isolation": False, "relevant_last": 2, "relevant_min_score": 0.9}
CASES = 24


class Asker:
    """Completions of token IDs through a router, one salt a case (vLLM's prefix cache and
    the store's keys apart per case)."""

    def __init__(self, client: httpx.Client, url: str, model: Path) -> None:
        self.client, self.url, self.model = client, url, str(model)

    def ask(self, ids: list[int], salt: str, params: dict[str, Any] | None = None) -> Any:
        body: dict[str, Any] = {"model": self.model, "prompt": ids, "max_tokens": 1}
        body |= {"cache_salt": salt} | ({"kv_transfer_params": params} if params else {})
        reply = self.client.post(f"{self.url}/v1/completions", json=body)
        reply.raise_for_status()
        return reply

    def store_every_document(self, ids: list[int], salt: str) -> None:
        """The case's documents stored (the router sends them cold, as their own prompts)
        from the case in reverse order kept as sent: vLLM's own prefix cache then holds
        nothing of the prompt as the router sends it but its sys."""
        self.ask(ids, salt, {"keep_order": True})

    def loaded(self, ids: list[int], salt: str) -> tuple[int, int]:
        """The tokens the router counts as loaded, and those the connector loaded."""
        reply = self.ask(ids, salt)
        details = reply.json()["usage"].get("prompt_tokens_details") or {}
        return int(reply.headers["x-chunkstore-stored-tokens"]), int(details["cached_tokens"])


def test_the_router_and_the_connector_decide_alike_from_one_setting(tiny_model_dir: Path) -> None:
    prompts = RagPrompts.for_model(tiny_model_dir, qa_cases.SYS)
    cases = qa_cases.generate(CASES, seed=0, docs_per_case=8)
    forward = [prompts.token_ids(c.documents, c.question) for c in cases]
    reverse = [prompts.token_ids(c.documents[::-1], c.question) for c in cases]
    work = Path(tempfile.mkdtemp(prefix="cs-up-", dir="/tmp"))  # short: the daemon's socket
    up = subprocess.Popen(
        [
            *(sys.executable, "-m", "chunkstore.cli", "up", "--model", str(tiny_model_dir)),
            *("--port", "0", "--max-model-len", "4096", "--workdir", str(work / "up")),
            *("--connector-config", json.dumps(SETTINGS)),
            *("--disk-dir", str(work / "disk")),
        ],
        stdout=subprocess.PIPE,
        stderr=(work / "up.log").open("w"),
        text=True,
        start_new_session=True,
    )
    control = None
    try:
        assert up.stdout is not None
        line = up.stdout.readline()
        assert line, (work / "up.log").read_text()[-3000:]
        url = json.loads(line)["url"]
        with httpx.Client(timeout=600) as client:
            asker = Asker(client, url, tiny_model_dir)
            for i, ids in enumerate(reverse):
                asker.store_every_document(ids, f"case-{i}")
            agreed = [asker.loaded(ids, f"case-{i}") for i, ids in enumerate(forward)]
            assert all(router == connector for router, connector in agreed), agreed
            assert all(router > 0 for router, _ in agreed)  # the documents before, loaded
            # The same instance behind a router on its defaults: it sends its (at most 3)
            # picks last and counts as loaded all but the last one's span, which it sizes
            # by its own picks; the connector sizes it by its own.
            instance = asker.ask(forward[0], "case-0").headers["x-chunkstore-instance"]
            daemon = f"unix:{work / 'up' / 'daemon' / 'chunkstore.sock'}"
            control = RunningRouter(
                work / "control",
                *("--instance", f"{instance}={daemon}", "--model", tiny_model_dir),
            )
            defaults = Asker(client, control.url, tiny_model_dir)
            for i, ids in enumerate(reverse):  # salts of its own: vLLM's prefix cache apart
                defaults.store_every_document(ids, f"control-{i}")
            apart = [defaults.loaded(ids, f"control-{i}") for i, ids in enumerate(forward)]
        assert any(router != connector for router, connector in apart), apart
        # up's daemon has the disk tier it was given: what it stored is written there too.
        deadline = time.monotonic() + 60
        while not list((work / "disk").rglob("*.entry")) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert list((work / "disk").rglob("*.entry")), (work / "up.log").read_text()[-3000:]
    finally:
        if control is not None:
            control.stop()
        stop_group(up)
        shutil.rmtree(work, ignore_errors=True)


def test_the_settings_are_given_once_as_the_connector_takes_them(tiny_model_dir: Path) -> None:
    """The router's flags that were the connector's settings are refused, saying where they
    went; a --connector-config that is no JSON object, or that names up's own daemon, is
    refused before anything starts."""
    from chunkstore.testing.cli import chunkstore

    model = ("--instance", "http://127.0.0.1:9", "--model", str(tiny_model_dir), "--port", "0")
    for flag, value in (("--isolation", "none"), ("--virtual-gap", "8"), ("--separator", "##")):
        done = chunkstore("router", *model, flag, value, timeout=120)
        assert done.returncode == 2 and "give them in --connector-config" in done.stderr
    done = chunkstore("router", *model, "--connector-config", "[1]", timeout=120)
    assert done.returncode == 2 and "must be a JSON object" in done.stderr, done.stderr
    for config, says in (("{oops", "is not JSON"), ('{"address": "unix:/x"}', "leave it out")):
        done = chunkstore("up", "--port", "0", "--connector-config", config, timeout=120)
        assert done.returncode == 2 and says in done.stderr, done.stderr
