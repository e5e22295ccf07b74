#!/bin/bash
# vLLM (CUDA) + KVTierConnector with the Llama-3.1-8B shape (dummy weights): host-tier hit after
# /reset_prefix_cache and TTFT from the host tier vs recompute (probe_tier.py).
# usage: serve_bench.sh OUTDIR [LENGTHS] [REPS]   (python3 must import vllm and kvtier)
set -u
OUTDIR=${1:?outdir}; LENGTHS=${2:-3000,16000}; REPS=${3:-5}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PY=${KVTIER_GPU_PYTHON:-python3}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 PYTHONUNBUFFERED=1
OUTDIR=$(cd "$OUTDIR" && pwd)
WORK=$(mktemp -d); MODEL=$WORK/model8b; cp -r "$HERE/model" "$MODEL"
cd "$WORK"  # python -m puts the cwd first on sys.path: a source checkout's kvtier/ (no connectors) must not shadow the installed one
KTC='{"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.connectors", "kv_role": "kv_both", "kv_connector_extra_config": {"cpu_bytes_to_use": '${KVTIER_GPU_POOL_BYTES:-8589934592}', "offload_prompt_only": false, "hash_seed": 0}}'
echo "kv-transfer-config: $KTC"
KVTIER_METRICS_PORT=8201 KVTIER_POD_NAME=gpu0 VLLM_SERVER_DEV_MODE=1 setsid nohup "$PY" -m vllm.entrypoints.openai.api_server \
  --model "$MODEL" --served-model-name m8b --load-format dummy --max-model-len 20480 \
  --gpu-memory-utilization ${KVTIER_GPU_MEM_UTIL:-0.4} --host 127.0.0.1 --port 8100 --enable-prefix-caching \
  --kv-transfer-config "$KTC" > "$OUTDIR/serve.log" 2>&1 < /dev/null &
P=$!
SERVER_PID=$P "$PY" "$HERE/probe_tier.py" http://127.0.0.1:8100 $(( $(date +%s) + ${KVTIER_GPU_HEALTH_S:-240} )) 8201 \
  "$OUTDIR/serve_bench.json" "$LENGTHS" "$REPS" 2>&1 | tee "$OUTDIR/probe.txt"
RC=${PIPESTATUS[0]}
grep -n -i -E "kvtier|cuda error|Traceback|Error" "$OUTDIR/serve.log" | grep -v -i "warn" | head -30
kill -TERM -- -$P 2>/dev/null; for i in $(seq 20); do kill -0 $P 2>/dev/null || break; sleep 1; done; kill -KILL -- -$P 2>/dev/null
exit $RC
