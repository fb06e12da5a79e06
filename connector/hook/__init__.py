"""The in-band isolation hook (worker process): the isolation mask inside vLLM's attention,
so a chunk vLLM computes in a request is the KV the store serves for it
(docs/isolation-hook.md).

- ``isolation``: ``IsolationHook``, what the worker installs; it holds a step's plans and
  split and what failed in it.
- ``vllm_attention``: the only code that touches vLLM's attention objects (one ``LayerCall``
  per layer call).
- ``step_split``: which rows of a step are which (``StepSplit``, built once per step).
- ``step_attention``: a layer's attention phases in the order the semantics need.
- ``recompute``: recomputing selected chunk tokens (the blend) and the isolated copies.
- ``bench``: ``chunkstore bench hook``, the kernel path against the merged one (found by
  ``chunkstore bench`` through its ``chunkstore.benches`` entry point).

Import each name from the module that defines it; this package re-exports nothing.
"""
