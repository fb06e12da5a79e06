#!/usr/bin/env bash
# Ascend: vLLM with vllm-ascend (and torch-npu, the `ascend` extra of this package) on the
# node, the daemon in the chunkstore:ascend image or as the systemd unit (`--device npu`
# puts its pool on the NPU, shared with the workers by IPC). The connector writes
# vllm-ascend's (key_cache, value_cache) pair in ND format once its start-up probe saw
# torch_npu._npu_reshape_and_cache put tokens where it reads them; keys are rotated on the
# NPU (npu_rotary_mul where its rules allow). An NZ-format or quantized cache, an MLA model,
# a failed probe: the connector says why and computes. The in-band isolation hook serves
# vLLM's CPU attention only. None of this has run on an NPU yet (docs/whats-left.md,
# "The connector on GPU / NPU back ends").
set -euo pipefail
MODEL=${MODEL:?set MODEL to the model folder}
HERE=$(cd "$(dirname "$0")" && pwd)
export ASCEND_RT_VISIBLE_DEVICES=${ASCEND_RT_VISIBLE_DEVICES:-0}
exec vllm serve "$MODEL" --kv-transfer-config "$(cat "$HERE/kv-transfer-config.json")" "$@"
