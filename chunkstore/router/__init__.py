"""``chunkstore router``: one OpenAI-compatible front door for vLLM instances that use the
connector (docs/router.md).

- keys: a prompt's pieces and their entry keys, and the prompt that stores a missing chunk
  alone (``sys SEP chunk SEP``): ``chunkstore.kv.keyspace``, the connector's own.
- ``access`` and ``limits``: who may make it work (the instance admits the caller first)
  and see how it works (operators), and the bounds on what one request may cost.
- ``order``: each prompt's relevant chunks moved last, where a back end without the hook
  computes them seeing the others (the connector's default answers there); the chunks
  before them are loaded.
- ``stores``: the daemons the instances use, asked which of those keys they hold.
- ``cold``: a chunked request's missing chunks sent to the chosen instance as their own
  one-token prefill requests, all in flight together and each sent once however many
  requests wait on it (single flight); then the request, now a hit on every chunk. A chunk
  computed as its own prompt is its isolated KV by construction on any attention back end,
  so chunk reuse works where the connector's in-band isolation hook does not run (CUDA,
  Ascend), and a cold request is answered as a warm one.
- ``instances``: the instances, their health and requests in flight; the choice of one by
  the tokens of the request its node already stores, weighted by load.
- ``app``: the HTTP surface (FastAPI on uvicorn, httpx to the instances, as vLLM itself
  ships): completions and chat completions, streamed or not, ``/v1/models``, ``/health``,
  ``/metrics``.
"""
