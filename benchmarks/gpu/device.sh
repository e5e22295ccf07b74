#!/bin/bash
# On a GPU machine without network (the lent H200), from the repository root, after
# benchmarks/gpu/pack.sh made .gpu/c1 .. .gpu/cN here. Commands back to back (the machine is
# reclaimed soon after a command ends):
#   1..N-1. (carry .gpu/cK)  mkdir -p /root/chunks && cp .gpu/cK/* /root/chunks/
#   N.      (carry .gpu/cN)  bash benchmarks/gpu/device.sh     # results under $OUT (or ./gpu-out)
# With the nixl folder (today: c1, c2 and the vLLM kernels c3, nixl c4), as run on 2026-12-04:
#   (carry .gpu/c1) mkdir -p /root/chunks && cp .gpu/c1/* /root/chunks/
#   (carry .gpu/c2 .gpu/c4) cp .gpu/c2/* .gpu/c4/* /root/chunks/
#   (carry .gpu/c3) export OUT; BENCH=peer SKIP_COPY=1 bash benchmarks/gpu/device.sh
# It unpacks vLLM into /tmp/site (skipped when already there), arranges kvtier from this
# working tree as installed (/tmp/kvt: connectors/ -> kvtier/connectors, ...), then runs
# ./run gpu-test's steps with that python: tests/gpu, bench_copy.py, serve_bench.sh
# (BENCH=itl: itl_bench.sh instead, decode inter-token latency with and without stores;
# BENCH=peer: bench_nixl.py (SKIP_NIXL=1: not) + peer_bench.sh, two instances with kvtier-peer, turn 2 on B pulled
# from A's host tier; BENCH=multi: pd_bench.sh, MultiConnector(NixlConnector, KVTierConnector)
# P/D and D->P; BENCH=ab: kvtier ab on the GPU stack (AB_STRATEGIES, default recompute,host-p2p;
# AB_TRACE; AB_ARGS); BENCH=none: no server; SKIP_TESTS=1 skips tests/gpu and bench_copy,
# SKIP_COPY=1 bench_copy only; SCATTER=1 runs bench_scatter.py, candidate fixes of the
# scattered-block store, before the server step; BUDGET_S: the server step ends by T0 + it). NixlConnector and peer fetch need nixl: pack.sh's last folder
# (nixl.tar.xz) is unpacked into /tmp/nixlsite when it was carried.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
R=$PWD; O=${OUT:-$R/gpu-out}; mkdir -p "$O"; T0=$(date +%s)
exec > >(tee "$O/device.txt") 2>&1
if [ -f /tmp/site/vllm/__init__.py ]; then echo "site already there"; else
  mkdir -p /root/chunks && for d in .gpu/c*; do cp $d/* /root/chunks/; done; ls -l /root/chunks
  cat /root/chunks/site.part-* > /root/site.tar.xz
  echo "sums: $(sha256sum /root/site.tar.xz /root/chunks/moe.tar.xz | awk '{print $1}' | tr '\n' ' ') want: $(tr '\n' ' ' < /root/chunks/sums.txt)"
  rm -rf /tmp/site && mkdir -p /tmp/site
  if command -v xz >/dev/null; then
    xz -dc /root/site.tar.xz | tar -xf - -C /tmp/site && xz -dc /root/chunks/moe.tar.xz | tar -xf - -C /tmp/site
  else
    python3 -c "import tarfile,sys; [tarfile.open(f,'r:xz').extractall('/tmp/site') for f in sys.argv[1:]]" /root/site.tar.xz /root/chunks/moe.tar.xz
  fi
fi
if [ ! -f /tmp/nixlsite/nixl/__init__.py ]; then
  for f in .gpu/c*/nixl.tar.xz /root/chunks/nixl.tar.xz; do
    [ -f "$f" ] || continue
    echo "nixl: $(sha256sum "$f" | awk '{print $1}') want: $(cat "$(dirname "$f")"/nixl.sum 2>/dev/null)"
    rm -rf /tmp/nixlsite && mkdir -p /tmp/nixlsite && xz -dc "$f" | tar -xf - -C /tmp/nixlsite && break
  done
fi
K=/tmp/kvt; rm -rf $K && mkdir -p $K
cp -r kvtier $K/kvtier && cp -r connectors $K/kvtier/connectors && cp -r indexer $K/kvtier/indexer \
  && cp -r router $K/kvtier/router && cp -r tests pyproject.toml $K/
export PYTHONPATH=$K:/tmp/site:/tmp/nixlsite PYTHONUNBUFFERED=1
echo "== t=$(( $(date +%s) - T0 )) $(python3 -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__, torch.cuda.get_device_name())' 2>&1 | grep -v Warn | tail -1)"
echo "nixl: $(python3 -c 'import nixl; from nixl._api import nixl_agent; print(nixl.__file__)' 2>&1 | tail -1)"
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader; df -h /dev/shm | tail -1
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  echo "== t=$(( $(date +%s) - T0 )) tests/gpu"
  (cd $K && python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu 2>&1 | tee "$O/gpu-tests.txt")
  if [ "${SKIP_COPY:-0}" != 1 ]; then
    echo "== t=$(( $(date +%s) - T0 )) bench_copy"
    python3 benchmarks/gpu/bench_copy.py --out "$O/bench_copy.json" --reps ${REPS:-9}
  fi
fi
if [ "${SCATTER:-0}" = 1 ]; then
  echo "== t=$(( $(date +%s) - T0 )) bench_scatter"
  timeout 90 python3 benchmarks/gpu/bench_scatter.py --out "$O/bench_scatter.json" --reps 9
fi
case "${BENCH:-serve}" in
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
      # The short A/B on the GPU stack: 1P1D, both instances on the one GPU (started one after
      # the other), trace + settings from benchmarks/traces/gpu-h200-8b-short.jsonl. From a
      # scratch folder: the checkout's kvtier/ (no connectors/) must not shadow /tmp/kvt.
      export VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
      LEFT=$(( T0 + ${BUDGET_S:-570} - $(date +%s) )); W=$(mktemp -d)
      (cd "$W" && timeout -s TERM $(( LEFT > 30 ? LEFT : 30 )) python3 -m kvtier.cli ab \
         --trace "$R/benchmarks/traces/${AB_TRACE:-gpu-h200-8b-short}.jsonl" \
         --model "$R/benchmarks/gpu/model" --block-size 16 --no-progress \
         --strategies "${AB_STRATEGIES:-recompute,host-p2p}" --out "$O/ab" ${AB_ARGS:-})
      echo "== kvtier ab rc=$?"
      for f in "$O"/ab/logs/*.log; do [ -f "$f" ] && { echo "--- $f"; grep -E "Error|error|Traceback|KV cache|ready" "$f" | tail -8; }; done ;;
  none) ;;
  *) echo "== t=$(( $(date +%s) - T0 )) serve_bench"
     bash benchmarks/gpu/serve_bench.sh "$O" "${LENGTHS:-3000,16000}" "${PROBE_REPS:-5}" ;;
esac
echo "== t=$(( $(date +%s) - T0 )) end"
