"""Device memory for the pool: the runtimes and the kernels that run on an accelerator.

- ``device_runtime``: what a device runtime is to the pool code (``DeviceIPC``, the
  ``IpcHandle`` it exports).
- ``device_ipc``: the pools shared between processes on a device (CUDA, Ascend through torch's
  sharing calls; ``runtime_for`` picks the back end), and their gathers and digests.
- ``fake_device``: a CPU stand-in for a device and its IPC calls (``--device fake``, CI).
- ``gather_triton``: the fused Triton get (gather and digest in one pass).

It sits above ``chunkstore.protocol`` (the shared-memory layout and the digest both ends
compute, ``shm`` and ``keyed_digest``; the CPU copy kernels ``shm`` runs, ``streamcopy`` and
``runs_kernel``, stay there with it) and below the daemon and the transports, which import it.
The chunk math's own device kernels (``kv.writer_triton``, ``kv.rope_npu``) stay in
``chunkstore.kv``, which picks them by the keys' device. Import each name from the module
that defines it; this package re-exports nothing.
"""
