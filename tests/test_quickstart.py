"""The README's quickstart, run as a new user runs it: its shell block pasted whole into bash
in the repository, with the daemon and vLLM on their defaults. It must finish, and the RAG
request in it must hit every document it ingested."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from chunkstore.processes.vllm_server import stop_group

ROOT = Path(__file__).resolve().parents[1]


def quickstart() -> str:
    """The first ```sh block under "## Quickstart" in README.md, as written."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Quickstart\n", 1)[1]
    match = re.search(r"```sh\n(.*?)```", section, re.S)
    assert match, "README: no shell block under ## Quickstart"
    return match.group(1)


@pytest.mark.slow
def test_the_readme_quickstart_runs_as_written(tmp_path: Path) -> None:
    script = quickstart()
    corpus = ROOT / "corpus.jsonl"  # the quickstart writes it where it runs
    assert not corpus.exists(), f"{corpus} is in the way of the quickstart"
    log = tmp_path / "quickstart.log"
    with log.open("w") as sink:  # a file: the servers it leaves running keep a pipe open
        run = subprocess.Popen(
            ["bash", "-e", "-c", script],
            cwd=ROOT,
            # as a user's shell has it: vLLM's engine in its own processes (tests/conftest.py)
            env={k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"},
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its background jobs share its process group
        )
        try:
            run.wait(timeout=900)
        finally:
            if run.poll() is None:
                run.kill()
            stop_group(run)  # the daemon removes its pool on SIGTERM
            corpus.unlink(missing_ok=True)
    out = log.read_text()
    assert run.returncode == 0, out[-6000:]
    [ingested] = [json.loads(line) for line in out.splitlines() if line.startswith('{"chunks"')]
    assert ingested["stored"] == ingested["chunks"] == 2
    # the servers write to the same log: read the stats JSON alone
    stats, _ = json.JSONDecoder().raw_decode(out, out.rindex('{\n  "entries"'))
    # The request's sys and both documents came from the store (the ingest's lookups
    # found nothing: the store was empty), so at least the documents' tokens hit.
    assert int(stats["hit_tokens"]) >= ingested["tokens"], out[-3000:]
