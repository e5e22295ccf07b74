#!/bin/bash
# P/D and D->P on one GPU with configs/multi-nixl-kvtier.json: MultiConnector(NixlConnector
# bidirectional, KVTierConnector) on a prefill server P (:8100) and a decode server D (:8200),
# --gpu-memory-utilization 0.35 each, the Llama-3.1-8B shape with dummy weights. NixlConnector's
# kv_buffer_device is set to cuda (the file ships cpu; on this machine the cpu buffer's D->P
# request never answered, see the report). NIXL between two processes on one GPU has no CUDA IPC
# here: every NIXL figure must be read with the link speed the probe measures next to it.
# usage: pd_bench.sh OUTDIR [LENGTHS] [REPS]   (python3 must import vllm, kvtier and nixl)
# env: DEADLINE (epoch s; default now + 480), KVTIER_GPU_POOL_BYTES (per instance, 8 GiB),
#      KVTIER_NIXL_BUFFER (cuda), KVTIER_GPU_MEM_UTIL (0.35), KVTIER_GPU_MAX_LEN (20480); for a
#      CPU dry run: KVTIER_GPU_MODEL, KVTIER_GPU_EXTRA_ARGS, KVTIER_GPU_BLOCK (16)
set -u
OUTDIR=${1:?outdir}; LENGTHS=${2:-2000,8000,16000}; REPS=${3:-2}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd); ROOT=$(cd "$HERE/../.." && pwd)
PY=${KVTIER_GPU_PYTHON:-python3}
DEADLINE=${DEADLINE:-$(( $(date +%s) + 480 ))}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 PYTHONUNBUFFERED=1
export VLLM_NIXL_SIDE_CHANNEL_HOST=127.0.0.1 KVTIER_P2P_HOST=127.0.0.1
OUTDIR=$(cd "$OUTDIR" && pwd)
WORK=$(mktemp -d); MODEL=$WORK/model8b; cp -r "${KVTIER_GPU_MODEL:-$HERE/model}" "$MODEL"
KTC=$("$PY" - "$ROOT/configs/multi-nixl-kvtier.json" "${KVTIER_GPU_POOL_BYTES:-8589934592}" "${KVTIER_NIXL_BUFFER:-cuda}" <<'EOF'
import json, sys
c = json.load(open(sys.argv[1]))
nixl, tier = c["kv_connector_extra_config"]["connectors"]
assert nixl["kv_connector"] == "NixlConnector" and tier["kv_connector"] == "KVTierConnector"
nixl["kv_buffer_device"] = sys.argv[3]
tier["kv_connector_extra_config"].update(cpu_bytes_to_use=int(sys.argv[2]), peer_timeout_s=60.0)
print(json.dumps(c))
EOF
) || { echo "cannot read configs/multi-nixl-kvtier.json"; exit 1; }
echo "kv-transfer-config (both): $KTC"
cd "$WORK"  # a source checkout's kvtier/ (no connectors) must not shadow the installed one
COMMON=(--model "$MODEL" --served-model-name m8b --load-format dummy --max-model-len ${KVTIER_GPU_MAX_LEN:-20480}
        --gpu-memory-utilization ${KVTIER_GPU_MEM_UTIL:-0.35} --host 127.0.0.1 --enable-prefix-caching
        --block-size ${KVTIER_GPU_BLOCK:-16} --kv-transfer-config "$KTC" ${KVTIER_GPU_EXTRA_ARGS:-})
start() {  # NAME PORT SIDE_CHANNEL P2P METRICS EVENTS REPLAY
  VLLM_NIXL_SIDE_CHANNEL_PORT=$3 KVTIER_POD_NAME=$1 KVTIER_P2P_PORT=$4 KVTIER_METRICS_PORT=$5 \
  KVTIER_TIER_EVENTS_PORT=$6 KVTIER_TIER_REPLAY_PORT=$7 VLLM_SERVER_DEV_MODE=1 \
  setsid nohup "$PY" -m vllm.entrypoints.openai.api_server "${COMMON[@]}" --port $2 \
    > "$OUTDIR/$1.log" 2>&1 < /dev/null &
  echo $!
}
PP=$(start gpu-p 8100 5600 8301 8201 8401 8402)
# One at a time: vLLM sizes its KV cache from the GPU memory it sees while profiling, and the other
# instance's allocations during that window leave it none ("No available memory for the cache
# blocks"). The second starts once the first has captured its CUDA graphs (or is healthy).
for i in $(seq 240); do
  grep -q -E "Graph capturing finished|Application startup complete" "$OUTDIR/gpu-p.log" 2>/dev/null && break
  kill -0 $PP 2>/dev/null || break
  [ $(date +%s) -lt $(( DEADLINE - 60 )) ] || break
  sleep 1
done
echo "second instance starts $i s after the first"
PD=$(start gpu-d 8200 5610 8311 8211 8411 8412)
echo "started P=$PP D=$PD; deadline in $(( DEADLINE - $(date +%s) )) s"
LEFT=$(( DEADLINE - $(date +%s) ))
SERVER_PIDS="$PP,$PD" timeout $(( LEFT > 5 ? LEFT : 5 )) "$PY" "$HERE/probe_pd.py" \
  --p http://127.0.0.1:8100 --d http://127.0.0.1:8200 --p-metrics 8201 --d-metrics 8211 \
  --out "$OUTDIR/pd_bench.json" --lengths "$LENGTHS" --reps "$REPS" --deadline "$DEADLINE" \
  --block-size ${KVTIER_GPU_BLOCK:-16} 2>&1 | tee "$OUTDIR/probe_pd.txt"
RC=${PIPESTATUS[0]}
echo "== probe rc=$RC"
for n in gpu-p gpu-d; do
  echo "== $n.log: kvtier / nixl / errors"
  grep -n -i -E "kvtier|cuda error|Traceback|Error|UCX|nixl|layout" "$OUTDIR/$n.log" \
    | grep -v -i -E "warn.*(ulimit|deprecat)|nixl_ep" | head -30
  [ $RC -eq 0 ] || { echo "== $n.log tail"; tail -40 "$OUTDIR/$n.log"; }
done
kill -TERM -- -$PP -$PD 2>/dev/null
for i in $(seq 15); do kill -0 $PP 2>/dev/null || kill -0 $PD 2>/dev/null || break; sleep 1; done
kill -KILL -- -$PP -$PD 2>/dev/null
rm -rf "$WORK"
exit $RC
