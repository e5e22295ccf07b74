#!/bin/bash
# The side-by-side on one GPU (probe_side.py): three vLLM servers with the Llama-3.1-8B shape
# (dummy weights), same flags, started together: BASE (no connector: recompute and the HBM
# prefix-cache hit), KVT (KVTierConnector) and OFF (vLLM's OffloadingConnector, CPU tier,
# offload_prompt_only false), each tier with HOST_BYTES of host memory (default 16 GiB). All three
# start at once: each has a fixed KV cache (KV_BYTES, default 7 GiB: 57k tokens; vLLM then skips
# the memory profiling a neighbour's start would disturb) and its own compile cache;
# --gpu-memory-utilization 0.3 (KVTIER_GPU_MEM_UTIL) is only vLLM's start-up check; --max-num-seqs 16.
# usage: side_bench.sh OUTDIR [LENGTHS 2000,8000,16000,32000] [REPS 5] [ROUNDS 3]
#        (python3 must import vllm and kvtier; DEADLINE: epoch by which the probe stops)
set -u
OUTDIR=${1:?outdir}; LENGTHS=${2:-2000,8000,16000,32000}; REPS=${3:-5}; ROUNDS=${4:-3}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PY=${KVTIER_GPU_PYTHON:-python3}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 PYTHONUNBUFFERED=1
export VLLM_SERVER_DEV_MODE=1  # /reset_prefix_cache
OUTDIR=$(cd "$OUTDIR" && pwd)
WORK=$(mktemp -d); MODEL=$WORK/model8b; cp -r "$HERE/model" "$MODEL"
cd "$WORK"  # a source checkout's kvtier/ (no connectors) must not shadow the installed one
HB=${HOST_BYTES:-17179869184}
KVT='{"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.connectors", "kv_role": "kv_both", "kv_connector_extra_config": {"cpu_bytes_to_use": '$HB', "offload_prompt_only": false, "hash_seed": 0}}'
OFF='{"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"cpu_bytes_to_use": '$HB', "offload_prompt_only": false}}'
COMMON=(--model "$MODEL" --served-model-name m8b --load-format dummy --max-model-len 33024
        --gpu-memory-utilization ${KVTIER_GPU_MEM_UTIL:-0.3} --max-num-seqs 16 --host 127.0.0.1
        --kv-cache-memory-bytes ${KV_BYTES:-7516192768} --enable-prefix-caching)
echo "KVT: $KVT"; echo "OFF: $OFF"
END=${DEADLINE:-$(( $(date +%s) + 480 ))}
up() {  # PORT PID: wait until the server answers /health (or died, or END passed)
  while [ "$(date +%s)" -lt "$END" ] && kill -0 "$2" 2>/dev/null; do
    curl -sf "http://127.0.0.1:$1/health" >/dev/null && { echo "port $1 up at t=$(( $(date +%s) - T0 ))"; return 0; }
    sleep 1
  done; echo "port $1 NOT up"; return 1
}
T0=$(date +%s)
# All at once (fixed KV cache sizes); each its own compile cache, so no two write one.
VLLM_CACHE_ROOT=$WORK/cache-base setsid nohup "$PY" -m vllm.entrypoints.openai.api_server \
  "${COMMON[@]}" --port 8100 > "$OUTDIR/side-base.log" 2>&1 < /dev/null &
B=$!
VLLM_CACHE_ROOT=$WORK/cache-kvt KVTIER_METRICS_PORT=8201 KVTIER_POD_NAME=gpu0 setsid nohup "$PY" \
  -m vllm.entrypoints.openai.api_server "${COMMON[@]}" --port 8101 --kv-transfer-config "$KVT" \
  > "$OUTDIR/side-kvtier.log" 2>&1 < /dev/null &
K=$!
VLLM_CACHE_ROOT=$WORK/cache-off setsid nohup "$PY" -m vllm.entrypoints.openai.api_server \
  "${COMMON[@]}" --port 8102 --kv-transfer-config "$OFF" > "$OUTDIR/side-offload.log" 2>&1 < /dev/null &
F=$!
up 8100 $B; up 8101 $K; up 8102 $F
"$PY" "$HERE/probe_side.py" http://127.0.0.1:8100 http://127.0.0.1:8101 http://127.0.0.1:8102 \
  "$END" "$OUTDIR/side.json" "$LENGTHS" "$REPS" "$ROUNDS" \
  2>&1 | tee "$OUTDIR/probe_side.txt"
RC=${PIPESTATUS[0]}
for p in 8100 8101 8102; do curl -s http://127.0.0.1:$p/metrics > "$OUTDIR/metrics-$p.txt"; done
curl -s http://127.0.0.1:8201/metrics > "$OUTDIR/metrics-kvtier.txt"
grep -h -E "^(vllm:external_prefix_cache_hits_total|vllm:kv_offload|kvtier_tier_bytes_moved)" "$OUTDIR"/metrics-*.txt | head -20
grep -n -i -E "cuda error|Traceback|Error|KV cache" "$OUTDIR"/side-*.log | grep -v -i warn | head -30
for P in $B $K $F; do kill -TERM -- -$P 2>/dev/null; done
for i in $(seq 20); do kill -0 $B 2>/dev/null || kill -0 $K 2>/dev/null || kill -0 $F 2>/dev/null || break; sleep 1; done
kill -KILL -- -$B -$K -$F 2>/dev/null
# servers' logs and metrics in one archive (the device tool returns at most 8 files)
(cd "$OUTDIR" && tar -czf side-logs.tar.gz side-*.log metrics-*.txt && rm -f side-*.log metrics-*.txt)
exit $RC
