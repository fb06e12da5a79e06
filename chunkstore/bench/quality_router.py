"""The ``router`` method of ``chunkstore bench quality``: the cases through a real
``chunkstore router`` before ``vllm serve`` with the hook off, over a daemon of its own."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from chunkstore.bench import qa_cases
from chunkstore.bench.quality_prompts import SEPARATOR, PromptFormat, Prompts
from chunkstore.bench.quality_scores import scored
from chunkstore.processes.daemon import start_daemon

BLOCK = 1 << 20  # the daemons' block size


def through_router(
    model: Path,
    cases: list[qa_cases.Case],
    prompts: Prompts,
    max_tokens: int,
    max_len: int,
    pool_bytes: int,
    folder: Path,
    fmt: PromptFormat,
) -> dict[str, Any]:
    """The ``router`` method: the cases through ``vllm serve`` (the hook off) behind a
    ``chunkstore router``, over an empty daemon, twice; ``scored``'s figures for the cold
    pass, the warm pass's beside them."""
    import httpx

    from chunkstore.processes.router import RunningRouter
    from chunkstore.processes.vllm_server import VllmServer

    with start_daemon(folder / "daemon", pool_bytes=pool_bytes, block_size=BLOCK) as daemon:
        settings = {"address": daemon.unix, "separator": SEPARATOR, "inband_isolation": False}
        # Prefix caching off, as the probes of the other methods run: the warm pass loads
        # the documents from the store, not vLLM's copy of the cold pass's prompt.
        no_apc = ("--no-enable-prefix-caching", "--enable-prompt-tokens-details")
        server = VllmServer(model, folder / "vllm", settings, max_len, extra=no_apc)
        router = None
        try:
            router = RunningRouter(
                folder / "router",
                *("--instance", server.url, "--address", daemon.unix),
                # The instance's kv_connector_extra_config: the router's keys and order follow it.
                *("--model", model, "--connector-config", json.dumps(settings)),
            )
            url = f"{router.url}/v1/completions"
            with httpx.Client(timeout=600) as client:

                def ask(prompt: list[int], tokens: int) -> tuple[str, dict[str, Any]]:
                    body = {"model": str(model), "prompt": prompt, "max_tokens": tokens}
                    began = time.perf_counter()
                    reply = client.post(url, json=body | {"temperature": 0.0})
                    took = time.perf_counter() - began
                    reply.raise_for_status()
                    answer = reply.json()
                    details = answer["usage"].get("prompt_tokens_details") or {}
                    loaded = {"seconds": took, "cached_tokens": details.get("cached_tokens")}
                    return fmt.answer(str(answer["choices"][0]["text"])), loaded

                cold, warm = ([ask(p, max_tokens)[0] for p in prompts.qa] for _ in range(2))
                timed = [ask(p, 1)[1] for p in prompts.timed]
        finally:
            if router is not None:
                router.stop()
            server.stop()
    res = scored(cases, cold, timed)
    warmed = scored(cases, warm, timed)
    res["warm_correct"], res["warm_per_case"] = warmed["correct"], warmed["per_case"]
    res["cold_equals_warm"] = cold == warm
    return res
