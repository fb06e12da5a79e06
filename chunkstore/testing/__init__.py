"""Test and bench helpers: the test models (``models``), the HF reference every served KV is
measured against (``reference``), and real processes started on free ports (``daemon``,
``dying_daemon``, ``redis``, ``prometheus``, ``vllm_probe``, ``vllm_server``, the ``cli``), and a
throw-away PKI (``pki``). A face: it may
import any part of chunkstore; nothing but the faces (cli, bench) and the tests import it."""
