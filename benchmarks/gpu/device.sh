#!/bin/bash
# On a GPU machine without network (the lent H100 or H200), from the repository root, after
# benchmarks/gpu/pack.sh made .gpu/c1 .. .gpu/cN here. One `run` call per folder, back to back
# (the machine is given back after 30 s idle); each carries one folder and copies it to /root/chunks,
# the last one also runs this script:
#   1..N-1. (carry .gpu/cK)  mkdir -p /root/chunks && cp .gpu/cK/* /root/chunks/
#   N.      (carry .gpu/cN)  export OUT; BENCH=side bash benchmarks/gpu/device.sh   # results under $OUT (or ./gpu-out)
# It joins the parts (site, moe, nixl), checks their sums, unpacks vLLM into /tmp/site and NIXL into
# /tmp/nixlsite (each skipped when already there), arranges kvtier from this working tree as
# installed (/tmp/kvt: connectors/ -> kvtier/connectors, ..., configs/ beside it), then runs
# ./run gpu-test's steps with that python: tests/gpu, bench_copy.py, then BENCH:
#   serve (default): serve_bench.sh, kvtier's host tier vs recompute;
#   side: side_bench.sh, the side-by-side on one GPU (kvtier's host tier, vLLM's OffloadingConnector,
#         recompute, the HBM hit; decode ITL while each stores), LENGTHS, PROBE_REPS, ITL_ROUNDS;
#   itl: itl_bench.sh, decode inter-token latency with and without stores;
#   peer: bench_nixl.py (SKIP_NIXL=1: not) + peer_bench.sh, two instances with kvtier-peer, turn 2 on
#         B pulled from A's host tier;
#   multi: pd_bench.sh, MultiConnector(NixlConnector, KVTierConnector) P/D and D->P;
#   ab: kvtier ab on the GPU stack (AB_STRATEGIES, default recompute,host-p2p; AB_TRACE; AB_ARGS);
#   none: no server.
# SKIP_TESTS=1 skips tests/gpu and bench_copy, SKIP_COPY=1 bench_copy only, GPU_TESTS picks
# test files (default tests/gpu); SCATTER=1 runs
# bench_scatter.py (the scattered-block store, graph gather vs per-layer kernels) before the server
# step; BUDGET_S: the server step ends by T0 + it (side: SIDE_S after it starts).
# BENCH may name several steps, run in order: BENCH=side,ab.
# DETACH=1: the whole script runs in the background (results in /root/gpu-run, its output in
# /root/gpu-run/device.txt) and this call returns at once; then `bash benchmarks/gpu/poll.sh S`
# calls (each waits up to S seconds) keep the machine held and bring the results back. Device
# time is spent while the machine is held, not by the call's length, so one run may outlast
# the 10-minute limit of a call.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ "${DETACH:-0}" = 1 ]; then
  rm -rf /root/gpu-run && mkdir -p /root/gpu-run /root/chunks
  for d in .gpu/c*; do [ -d "$d" ] && cp "$d"/* /root/chunks/; done
  DETACH=2 OUT=/root/gpu-run setsid nohup bash "$0" > /root/gpu-run.log 2>&1 < /dev/null &
  echo "detached: pid $! (results in /root/gpu-run; bash benchmarks/gpu/poll.sh SECONDS)"; exit 0
fi
R=$PWD; O=${OUT:-$R/gpu-out}; mkdir -p "$O"; T0=$(date +%s)
trap 'touch "$O/.done"' EXIT
exec > >(tee "$O/device.txt") 2>&1
mkdir -p /root/chunks && for d in .gpu/c*; do [ -d "$d" ] && cp "$d"/* /root/chunks/; done
unpack() {  # ARCHIVE DEST MARKER: join ARCHIVE's parts, check the sum, unpack into DEST
  local a=$1 d=$2 m=$3
  if [ -e "$m" ]; then echo "$a: already there"; return; fi
  ls /root/chunks/$a.part-* >/dev/null 2>&1 || { echo "$a: no parts carried"; return; }
  cat /root/chunks/$a.part-* > /root/$a.tar.xz
  echo "$a: $(sha256sum /root/$a.tar.xz | cut -d' ' -f1) want: $(grep " $a.tar.xz" /root/chunks/sums.txt | cut -d' ' -f1)"
  mkdir -p "$d"
  if command -v xz >/dev/null; then xz -dc /root/$a.tar.xz | tar -xf - -C "$d"
  else python3 -c "import tarfile,sys; tarfile.open(sys.argv[1],'r:xz').extractall(sys.argv[2])" /root/$a.tar.xz "$d"; fi
}
unpack site /tmp/site /tmp/site/vllm/__init__.py
unpack moe /tmp/site /tmp/site/vllm/_moe_C_stable_libtorch.abi3.so
unpack nixl /tmp/nixlsite /tmp/nixlsite/nixl/__init__.py
K=/tmp/kvt; rm -rf $K && mkdir -p $K
cp -r kvtier $K/kvtier && cp -r connectors $K/kvtier/connectors && cp -r indexer $K/kvtier/indexer \
  && cp -r router $K/kvtier/router && cp -r tests configs pyproject.toml $K/ \
  && mkdir -p $K/benchmarks/gpu && cp -r benchmarks/gpu/model $K/benchmarks/gpu/
export PYTHONPATH=$K:/tmp/site:/tmp/nixlsite PYTHONUNBUFFERED=1
echo "== t=$(( $(date +%s) - T0 )) $(python3 -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__, torch.cuda.get_device_name())' 2>&1 | grep -v Warn | tail -1)"
echo "nixl: $(python3 -c 'import nixl; from nixl._api import nixl_agent; print(nixl.__file__)' 2>&1 | tail -1)"
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader; df -h /dev/shm | tail -1
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  echo "== t=$(( $(date +%s) - T0 )) tests/gpu"
  (cd $K && python3 -m pytest -q -p no:cacheprovider -m gpu ${GPU_TESTS:-tests/gpu} 2>&1 | tee "$O/gpu-tests.txt")
  if [ "${SKIP_COPY:-0}" != 1 ]; then
    echo "== t=$(( $(date +%s) - T0 )) bench_copy"
    python3 benchmarks/gpu/bench_copy.py --out "$O/bench_copy.json" --reps ${REPS:-9}
  fi
fi
if [ "${SCATTER:-0}" = 1 ]; then
  echo "== t=$(( $(date +%s) - T0 )) bench_scatter"
  timeout 150 python3 benchmarks/gpu/bench_scatter.py --out "$O/bench_scatter.json" --reps 25
fi
bench() {
case "$1" in
  itl) echo "== t=$(( $(date +%s) - T0 )) itl_bench"
       bash benchmarks/gpu/itl_bench.sh "$O" ${ITL_ARGS:-} ;;
  peer) if [ "${SKIP_NIXL:-0}" != 1 ]; then
          echo "== t=$(( $(date +%s) - T0 )) bench_nixl"
          timeout 90 python3 benchmarks/gpu/bench_nixl.py --out "$O/bench_nixl.json"
        fi
        echo "== t=$(( $(date +%s) - T0 )) peer_bench"
        DEADLINE=$(( T0 + ${BUDGET_S:-540} )) bash benchmarks/gpu/peer_bench.sh "$O" "${LENGTHS:-2000,8000,16000,32000}" "${PROBE_REPS:-3}" ;;
  multi) echo "== t=$(( $(date +%s) - T0 )) pd_bench"
         DEADLINE=$(( T0 + ${BUDGET_S:-540} )) bash benchmarks/gpu/pd_bench.sh "$O" "${LENGTHS:-2000,8000,16000}" "${PROBE_REPS:-2}" ;;
  ab) echo "== t=$(( $(date +%s) - T0 )) kvtier ab"
      # kvtier ab on the GPU stack: 1P1D, both instances on the one GPU, trace + settings from
      # benchmarks/traces/$AB_TRACE.jsonl (AB_ARGS=--single-engine: one engine per strategy,
      # no P/D split, AB_STRATEGIES=recompute,host-p2p,vllm-offload). From a scratch folder: the checkout's kvtier/ (no
      # connectors/) must not shadow /tmp/kvt. A device-to-device copy first, the anchor of the
      # D->P reads' bandwidth.
      python3 -c 'import json,sys,torch
x=torch.empty(1<<30,dtype=torch.uint8,device="cuda"); y=torch.empty_like(x); y.copy_(x)
e=[torch.cuda.Event(enable_timing=True) for _ in range(2)]; t=[]
for _ in range(9):
  e[0].record(); y.copy_(x); e[1].record(); torch.cuda.synchronize(); t.append(e[0].elapsed_time(e[1]))
t.sort(); json.dump({"bytes":1<<30,"median_ms":t[4],"gb_s":(1<<30)/t[4]/1e6,"ms":t,"device":torch.cuda.get_device_name()},open(sys.argv[1],"w"))' "$O/d2d_copy.json" && cat "$O/d2d_copy.json"; echo
      # beside the run's report, the anchor of its D->P link section (kvtier.ab.link)
      mkdir -p "$O/ab" && cp "$O/d2d_copy.json" "$O/ab/" 2>/dev/null
      # UCX turns cuda_ipc GET (a NIXL READ, vLLM's D->P read) off on a GPU without NVLink,
      # so reads between two processes on the one lent card fell back to TCP (0.06 GB/s);
      # on, they ran at 16 GB/s (benchmarks/AB.md, the GPU section). A set value is kept.
      export UCX_CUDA_IPC_ENABLE_GET_ZCOPY=${UCX_CUDA_IPC_ENABLE_GET_ZCOPY:-on}
      export VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
      LEFT=$(( T0 + ${BUDGET_S:-570} - $(date +%s) )); W=$(mktemp -d)
      (cd "$W" && timeout -s TERM $(( LEFT > 30 ? LEFT : 30 )) python3 -m kvtier.cli ab \
         --trace "$R/benchmarks/traces/${AB_TRACE:-gpu-h200-8b-short}.jsonl" \
         --model "$R/benchmarks/gpu/model" --block-size 16 --no-progress \
         --strategies "${AB_STRATEGIES:-recompute,host-p2p}" --out "$O/ab" ${AB_ARGS:-})
      echo "== kvtier ab rc=$?"
      for f in "$O"/ab/logs/*/*.log "$O"/ab/logs/*.log; do [ -f "$f" ] && { echo "--- $f"; grep -E "Error|error|Traceback|KV cache|ready" "$f" | tail -8; }; done ;;
  side) echo "== t=$(( $(date +%s) - T0 )) side_bench"
        DEADLINE=$(( $(date +%s) + ${SIDE_S:-540} )) bash benchmarks/gpu/side_bench.sh "$O" \
          "${LENGTHS:-2000,8000,16000,32000}" "${PROBE_REPS:-5}" "${ITL_ROUNDS:-3}" ;;
  none) ;;
  *) echo "== t=$(( $(date +%s) - T0 )) serve_bench"
     bash benchmarks/gpu/serve_bench.sh "$O" "${LENGTHS:-3000,16000}" "${PROBE_REPS:-5}" ;;
esac
}
B=${BENCH:-serve}; for b in ${B//,/ }; do bench "$b"; done
echo "== t=$(( $(date +%s) - T0 )) end"
