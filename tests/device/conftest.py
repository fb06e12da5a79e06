"""The device suite (``make test-device``; ``scripts/device-check`` on a bare GPU machine):
what runs on a real GPU or NPU where one exists, and on the CPU stand-in (``fake``)
everywhere. A real device missing is a skip, said as such; the fake runs always, so the pool
logic is proven on every host.

``CHUNKSTORE_TEST_DEVICE`` (cpu, cuda or npu; set by the device check) names the device the
KV math runs on: then it is the only one, and its absence fails instead of skipping. With
``cpu`` the device path runs against its CPU reference on the CPU, which proves the check
itself runs (CI does this in a venv holding only what the GPU machine has)."""

from __future__ import annotations

import os

import pytest

from chunkstore.testing.devices import real_devices

ENV = "CHUNKSTORE_TEST_DEVICE"


CHOSEN = os.environ.get(ENV, "")
DEVICES = [
    "fake",
    *(
        pytest.param(
            kind, marks=pytest.mark.skipif(kind not in real_devices(), reason=f"no {kind}")
        )
        for kind in ("cuda", "npu")
        if CHOSEN in ("", kind)
    ),
]


@pytest.fixture(params=DEVICES)
def pool_device(request: pytest.FixtureRequest) -> str:
    """A pool device kind: the fake always, cuda / npu where this host has them."""
    return str(request.param)


@pytest.fixture(params=[CHOSEN] if CHOSEN else ["cuda", "npu"])
def accelerator(request: pytest.FixtureRequest) -> str:
    """The device the KV math runs on: ``CHUNKSTORE_TEST_DEVICE``, else each real
    accelerator kind (skipped where this host has none of it)."""
    kind = str(request.param)
    if kind != "cpu" and kind not in real_devices():
        if CHOSEN:
            pytest.fail(f"{ENV}={CHOSEN} but torch sees no {kind} device")
        pytest.skip(f"no {kind} device on this host")
    return kind
