#!/bin/bash
# Decode inter-token latency with and without host-tier stores (probe_itl.py): two vLLM servers on
# the one GPU with the Llama-3.1-8B shape (dummy weights), BASE without a connector and TIER with
# KVTierConnector (every finished request stored to the host tier), measured in turn.
# usage: itl_bench.sh OUTDIR [ROUNDS] [GEN] [PROMPT] [INTERVAL]   (python3 must import vllm and kvtier)
set -u
OUTDIR=${1:?outdir}; shift
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PY=${KVTIER_GPU_PYTHON:-python3}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 PYTHONUNBUFFERED=1
OUTDIR=$(cd "$OUTDIR" && pwd)
WORK=$(mktemp -d); MODEL=$WORK/model8b; cp -r "$HERE/model" "$MODEL"
cd "$WORK"  # a source checkout's kvtier/ (no connectors) must not shadow the installed one
KTC='{"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.connectors", "kv_role": "kv_both", "kv_connector_extra_config": {"cpu_bytes_to_use": '${KVTIER_GPU_POOL_BYTES:-8589934592}', "offload_prompt_only": false, "hash_seed": 0}}'
COMMON=(--model "$MODEL" --served-model-name m8b --load-format dummy --max-model-len 8192
        --gpu-memory-utilization ${KVTIER_GPU_MEM_UTIL:-0.4} --host 127.0.0.1 --enable-prefix-caching)
setsid nohup "$PY" -m vllm.entrypoints.openai.api_server "${COMMON[@]}" --port 8100 \
  > "$OUTDIR/itl-base.log" 2>&1 < /dev/null &
B=$!
KVTIER_METRICS_PORT=8201 KVTIER_POD_NAME=gpu0 setsid nohup "$PY" -m vllm.entrypoints.openai.api_server \
  "${COMMON[@]}" --port 8101 --kv-transfer-config "$KTC" > "$OUTDIR/itl-tier.log" 2>&1 < /dev/null &
T=$!
"$PY" "$HERE/probe_itl.py" http://127.0.0.1:8100 http://127.0.0.1:8101 \
  $(( $(date +%s) + ${KVTIER_GPU_HEALTH_S:-240} )) "$OUTDIR/itl.json" "$@" 2>&1 | tee "$OUTDIR/itl.txt"
RC=${PIPESTATUS[0]}
curl -s http://127.0.0.1:8201/metrics | grep -E "^kvtier_tier_(bytes_moved|blocks_held|evictions|stores_refused)" | head -8
grep -n -i -E "cuda error|Traceback|Error" "$OUTDIR/itl-base.log" "$OUTDIR/itl-tier.log" | grep -v -i warn | head -20
for P in $B $T; do kill -TERM -- -$P 2>/dev/null; done
for i in $(seq 20); do kill -0 $B 2>/dev/null || kill -0 $T 2>/dev/null || break; sleep 1; done
kill -KILL -- -$B -$T 2>/dev/null
exit $RC
