#!/usr/bin/env bash
# Ascend: vLLM with vllm-ascend (and torch-npu, the `ascend` extra of this package) on the
# node, the daemon in the chunkstore:ascend image or as the systemd unit. The connector's key
# rotation runs through torch-npu's npu_rotary_mul on NPU tensors (chunkstore/rope_npu.py);
# writing into vllm-ascend's paged cache and the NPU pool are not built yet (README, "What is
# left"), so on Ascend the connector today finds no usable cache layout and computes.
set -euo pipefail
MODEL=${MODEL:?set MODEL to the model folder}
HERE=$(cd "$(dirname "$0")" && pwd)
export ASCEND_RT_VISIBLE_DEVICES=${ASCEND_RT_VISIBLE_DEVICES:-0}
exec vllm serve "$MODEL" --kv-transfer-config "$(cat "$HERE/kv-transfer-config.json")" "$@"
