"""A method of ``chunkstore bench quality``: its spec (``--methods``) parsed into settings,
and what the connector's one policy (``ConnectorConfig.policy``) does with a prompt's chunks
under them: which it recomputes, which it attends last, and what share that is."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from chunkstore.bench import qa_cases
from chunkstore.connector_config import ConnectorConfig, model_limits, served_on_model
from chunkstore.kv.segments import SegmentKind, split_prompt
from chunkstore.policy.treatment import QualityConfig, Treatment

FULL, ISOLATED, DEFAULT = "full", "isolated", "default"
# The curve of each knob, and the combinations worth a row: sized to run in under an hour
# on Qwen2.5-Coder-0.5B with the default cases.
DEFAULT_METHODS = (
    FULL,
    ISOLATED,
    "recompute_by=relevance+recompute_chunks=1",
    "recompute_by=position+recompute_chunks=1",
    "recompute_by=position+recompute_chunks=2",
    "recompute_by=relevance+recompute_chunks=2",
    "request=1",
    "request=2",
    "virtual_gap=200",
    "recompute_tokens=16",
)
# Not a connector setting: the bench passes each prompt's kv_transfer_params naming the
# first N chunks of an oracle ranking (the documents holding the answer, then the others
# from the question back), as an application's retriever would.
REQUEST = "request"
# Not a connector setting either: kv_transfer_params {"chunk_scores": the oracle ranking}.
SCORES, ORACLE = "scores", "oracle"

# Not a connector setting either: ``order=relevant`` sends each prompt with its relevant
# documents last, as the router does (``chunkstore.router.order``); with
# ``inband_isolation=0`` that is what a CUDA or Ascend back end answers behind the router.
ORDER, RELEVANT = "order", "relevant"
# Through a real router process: what it sends is the relevant-last order, the hook off.
ROUTER = "router"


def _flag(value: str) -> bool:
    if value not in ("0", "1"):
        raise ValueError(f"a flag is 0 or 1, not {value!r}")
    return value == "1"


KNOBS: dict[str, Callable[[str], Any]] = {
    "virtual_gap": int,
    "inband_isolation": _flag,
    **QualityConfig.names(),
    REQUEST: int,
    SCORES: str,
    ORDER: str,
}


def parse_method(spec: str) -> dict[str, Any] | None:
    """``full`` -> None (no connector); ``isolated`` -> nothing recovered; ``default``
    -> {}; ``a=1+b=0.5`` -> {a: 1, b: 0.5}."""
    if spec == FULL:
        return None
    if spec == ISOLATED:
        return {"recompute_chunks": 0, "relevant_last": 0}
    if spec == DEFAULT:
        return {}
    if spec == ROUTER:
        return {"inband_isolation": False, ORDER: RELEVANT}
    settings: dict[str, Any] = {}
    for part in spec.split("+"):
        name, _, value = part.partition("=")
        if name not in KNOBS or not value:
            raise ValueError(
                f"bad method {spec!r}: use full, isolated, default or KNOB=VALUE[+KNOB=VALUE] "
                f"with KNOB one of {', '.join(KNOBS)}"
            )
        settings[name] = KNOBS[name](value)
    if settings.get(SCORES, ORACLE) != ORACLE:
        raise ValueError(f"bad method {spec!r}: scores=oracle is the one ranking the bench has")
    if settings.get(ORDER, RELEVANT) != RELEVANT or (ORDER in settings and REQUEST in settings):
        raise ValueError(f"bad method {spec!r}: order=relevant, without request=N")
    return settings


def parse_methods(text: str) -> list[tuple[str, dict[str, Any] | None]]:
    """``--methods``: each spec parsed and its settings checked, before anything runs."""
    methods = []
    for spec in text.split(","):
        try:
            settings = parse_method(spec)
            if settings:
                ConnectorConfig.from_extra(connector_settings(settings))
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        methods.append((spec, settings))
    return methods


def connector_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """A method's settings without the bench's own ``request``, ``scores`` and ``order``."""
    return {k: v for k, v in settings.items() if k not in (REQUEST, SCORES, ORDER)}


def oracle_ranking(relevant: tuple[int, ...], chunks: int) -> list[int]:
    """An application's ranking of a case's chunks: those holding the answer, then the
    others from the question back."""
    return [*relevant, *(i for i in reversed(range(chunks)) if i not in relevant)]


def served_config(settings: dict[str, Any], hf_config: Any = None) -> ConnectorConfig:
    """A method's connector settings as the connector serves them for the model of
    ``hf_config`` (``served_on_model``: with sliding-window layers the hook does no moves or
    recompute; None: a model it serves every setting for)."""
    config = ConnectorConfig.from_extra(connector_settings(settings))
    return config if hf_config is None else served_on_model(config, hf_config)


def hook_limits_of(settings: dict[str, Any] | None, hf_config: Any) -> str | None:
    """Why the connector serves a method otherwise than its settings say on this model
    (``served_config``); None where it serves them as they are."""
    if settings is None:
        return None
    asked, served = served_config(settings), served_config(settings, hf_config)
    if (asked.quality, asked.inband_isolation) == (served.quality, served.inband_isolation):
        return None
    if not served.inband_isolation:
        return "the hook is off for this model with these settings: chunks load as stored"
    return model_limits(hf_config)


def treatment(
    settings: dict[str, Any],
    prompt: list[int],
    sep: list[int],
    ranking: list[int],
    hf_config: Any = None,
) -> tuple[Treatment, list[int]]:
    """What a method does with a prompt's chunks, as the connector decides it (the one
    policy, ``chunkstore.policy.treatment``, with the settings it serves for the model of
    ``hf_config``: ``served_config``), given the kv_transfer_params the bench sends with
    it; and the segment index of each chunk (chunk ``c`` is segment ``chunks[c]``)."""
    segments = split_prompt(prompt, sep)
    config = served_config(settings, hf_config)
    params = transfer_params(ranking, int(settings.get(REQUEST, 0)), settings.get(SCORES) == ORACLE)
    treated = config.policy.treat(segments, params)
    return treated, [i for i, seg in enumerate(segments) if seg.kind is SegmentKind.CHUNK]


def recomputed_share(
    prompts: list[list[int]],
    sep: list[int],
    settings: dict[str, Any],
    rankings: list[list[int]],
    hf_config: Any = None,
) -> float:
    """The share of the prompts' chunk tokens a method recomputes: the offsets it recomputes
    in each chunk, and the first tokens of every chunk (its separator included) but the one
    attended right after sys where that is causal already (as the connector leaves it)."""
    total = recomputed = 0
    for prompt, ranking in zip(prompts, rankings, strict=True):
        treated, chunks = treatment(settings, prompt, sep, ranking, hf_config)
        segments = split_prompt(prompt, sep)
        sys_end = segments[0].end
        starts = [segments[i].start + treated.shifts.get(i, 0) for i in chunks]
        first = chunks[starts.index(sys_end)] if treated.first_is_causal else -1
        for index in chunks:
            seg = segments[index]
            total += len(seg)
            span = treated.recomputed.get(index, range(0))
            blends = treated.first_tokens if index != first else 0
            recomputed += sum(1 for p in range(len(seg)) if p < blends or p in span)
    return recomputed / max(1, total)


def exact_and_last(treated: Treatment, chunks: list[int]) -> tuple[set[int], set[int]]:
    """The chunks (chunk indices) a treatment gives their full-prefill KV (recomputed, or
    the first staying first where that is causal already) and those it attends last."""
    of = {segment: c for c, segment in enumerate(chunks)}
    return {of[i] for i in treated.exact}, {of[i] for i in treated.last}


def recomputed_fields(
    settings: dict[str, Any],
    cases: list[qa_cases.Case],
    sep: list[int],
    qa: tuple[list[list[int]], list[list[int]]],
    timed: tuple[list[list[int]], list[list[int]]],
    hf_config: Any = None,
) -> dict[str, Any]:
    """What a method recomputes on the model of ``hf_config`` (``served_config``): the share
    of chunk tokens (``recomputed_share``), and in how many cases (of those naming them)
    every answer document was among the chunks recomputed or put last (``qa`` and
    ``timed``: prompts and their oracle rankings)."""
    qa_ids, qa_rankings = qa
    fields: dict[str, Any] = {
        "recomputed_share": {
            "qa": round(recomputed_share(qa_ids, sep, settings, qa_rankings, hf_config), 3),
            "ttft": round(recomputed_share(timed[0], sep, settings, timed[1], hf_config), 3),
        }
    }
    chosen = [
        exact_and_last(*treatment(settings, p, sep, r, hf_config))
        for p, r in zip(qa_ids, qa_rankings, strict=True)
    ]
    # The answer's chunks where the prompt has them: the oracle ranking's first (renamed
    # with the prompt where the method reorders it).
    known = [
        (set(ranking[: len(case.relevant)]), c)
        for case, ranking, c in zip(cases, qa_rankings, chosen, strict=True)
        if case.relevant
    ]
    for field, which in (("answer_chunks_recomputed", 0), ("answer_chunks_last", 1)):
        if known and any(c[which] for c in chosen):  # (a user's case may not say)
            found = sum(answer <= c[which] for answer, c in known)
            fields[field] = round(found / len(known), 3)
    return fields


def transfer_params(ranking: list[int], requested: int, scores: bool) -> dict[str, Any] | None:
    """A prompt's kv_transfer_params: ``request=N`` names the ranking's first N chunks,
    ``scores=oracle`` gives it as chunk_scores (the first chunk of the ranking highest)."""
    if requested:
        return {"recompute_chunks": sorted(ranking[:requested])}
    if scores:
        return {
            "chunk_scores": [float(len(ranking) - ranking.index(i)) for i in range(len(ranking))]
        }
    return None


def probe_entry(
    prompt: list[int], max_tokens: int | None, ranking: list[int], requested: int, scores: bool
) -> dict[str, Any]:
    """A probe prompt, with its kv_transfer_params (``_transfer_params``)."""
    entry: dict[str, Any] = {"prompt_token_ids": prompt}
    if max_tokens is not None:
        entry["max_tokens"] = max_tokens
    params = transfer_params(ranking, requested, scores)
    if params is not None:
        entry["kv_transfer_params"] = params
    return entry
