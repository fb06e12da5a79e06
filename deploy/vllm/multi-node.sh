#!/usr/bin/env bash
# Several nodes: one daemon per node (the DaemonSet of deploy/k8s, or the systemd unit), and on
# every node vLLM talks to its own daemon over the node-local socket. Each node keeps and
# serves the chunks it computed; pre-warm every node with `chunkstore ingest --server` against
# that node's vLLM. (With `--redis` on every daemon, a node also pulls the chunks another node
# computed: docs/daemon.md, "Cluster directory (optional)".) Run this on each node, e.g. with
# tensor parallelism:
set -euo pipefail
MODEL=${MODEL:?set MODEL to the model folder}
HERE=$(cd "$(dirname "$0")" && pwd)
exec vllm serve "$MODEL" --tensor-parallel-size "${TP:-1}" \
  --kv-transfer-config "$(cat "$HERE/kv-transfer-config.json")" "$@"
