"""Test helpers: the HF reference every served KV is measured against (``reference``), the
RAG scenario the end-to-end tests share (``scenario``), what tests store in a daemon and how
they wait on it (``entries``), real processes only tests start (``dying_daemon``,
``prometheus``, ``vllm_server``, the ``cli``), and a throw-away PKI (``pki``). A face: it may
import any part of chunkstore; only the tests import it (what ``chunkstore`` commands run,
``chunkstore.models`` and ``chunkstore.processes``, lives outside it)."""
