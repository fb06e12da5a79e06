"""The device suite (``make test-device``): what runs on a real GPU or NPU where one exists,
and on the CPU stand-in (``fake``) everywhere. A real device missing is a skip, said as such;
the fake runs always, so the pool logic is proven on every host."""

from __future__ import annotations

import importlib.util

import pytest
import torch


def real_devices() -> list[str]:
    """The accelerator kinds this host has, as torch sees them."""
    found = []
    if torch.cuda.is_available():
        found.append("cuda")
    if importlib.util.find_spec("torch_npu") is not None:
        import torch_npu  # noqa: F401

        if torch.npu.is_available():  # type: ignore[attr-defined]
            found.append("npu")
    return found


DEVICES = [
    "fake",
    *(
        pytest.param(
            kind, marks=pytest.mark.skipif(kind not in real_devices(), reason=f"no {kind}")
        )
        for kind in ("cuda", "npu")
    ),
]


@pytest.fixture(params=DEVICES)
def pool_device(request: pytest.FixtureRequest) -> str:
    """A pool device kind: the fake always, cuda / npu where this host has them."""
    return str(request.param)


@pytest.fixture(params=[k for k in ("cuda", "npu")])
def accelerator(request: pytest.FixtureRequest) -> str:
    """A real accelerator kind (skipped where this host has none of it)."""
    if request.param not in real_devices():
        pytest.skip(f"no {request.param} device on this host")
    return str(request.param)
