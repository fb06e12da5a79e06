"""The vLLM KV connector, installed as ``chunkstore_vllm`` (a bare ``connector`` module would
collide in a shared site-packages). Split by the process a line runs in: ``scheduler``
decides, ``worker`` moves bytes, ``common`` holds what travels between them; ``connector``
is the class vLLM loads. It reaches the store only through ``chunkstore.client`` and the
math (``chunkstore.kv``), plus the ingest face built on them; never the daemon's internals
or the protocol directly."""
