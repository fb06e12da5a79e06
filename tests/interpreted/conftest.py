"""The Triton kernels (``kv/writer_triton``, ``protocol/gather_triton``) run by Triton's
interpreter on CPU tensors, in a pytest process of their own that has TRITON_INTERPRET=1 from
its start (``tests/test_interpreted.py`` starts it; the suite's own process skips them).

Triton takes its mode when it is first imported: its library's own jitted functions
(``tl.zeros`` among them) are compiled-mode ones in a process that imported vLLM first, as the
suite's does (its probes fork from one), and an interpreted kernel cannot call them."""

from __future__ import annotations

import os

collect_ignore_glob = [] if os.environ.get("TRITON_INTERPRET") == "1" else ["test_*.py"]
