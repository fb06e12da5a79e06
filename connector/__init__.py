"""The vLLM KV connector (installed as ``chunkstore_vllm``; a bare ``connector`` module would
collide in a shared site-packages). It arrives with issue 4; the chunk math it stands on is in
``chunkstore`` (segments, keys, rope, masks, paging, writer)."""
