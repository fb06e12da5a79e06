"""chunkstore: a position-independent KV-cache service for RAG serving.

The chunk math (segmentation, keys, RoPE remap, isolation masks, paging) lives in pure
modules here and is shared by the daemon, the vLLM connector, the tests and the benches.
"""

__version__ = "0.1.0"
