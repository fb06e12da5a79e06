"""The Triton kernels (``kv/writer_triton``, ``device/gather_triton``) run by Triton's
interpreter on CPU tensors, in a pytest process of their own that has TRITON_INTERPRET=1 from
its start (``tests/test_interpreted.py`` starts it; the suite's own process skips them).

Triton takes its mode when it is first imported: its library's own jitted functions
(``tl.zeros`` among them) are compiled-mode ones in a process that imported vLLM first, as the
suite's does (its probes fork from one), and an interpreted kernel cannot call them."""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest

collect_ignore_glob = [] if os.environ.get("TRITON_INTERPRET") == "1" else ["test_*.py"]


@pytest.fixture(scope="module")
def kernel(request: pytest.FixtureRequest) -> ModuleType:
    """The test module's ``KERNEL`` (a module name), its kernels run by the interpreter: this
    process has TRITON_INTERPRET=1 from its start, so a plain import is an interpreted one."""
    return importlib.import_module(request.module.KERNEL)
