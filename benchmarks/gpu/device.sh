#!/bin/bash
# On a GPU machine without network (the lent H200), from the repository root, after
# benchmarks/gpu/pack.sh made .gpu/c1 .. .gpu/cN here. Commands back to back (the machine is
# reclaimed soon after a command ends):
#   1..N-1. (carry .gpu/cK)  mkdir -p /root/chunks && cp .gpu/cK/* /root/chunks/
#   N.      (carry .gpu/cN)  bash benchmarks/gpu/device.sh     # results under $OUT (or ./gpu-out)
# It unpacks vLLM into /tmp/site (skipped when already there), arranges kvtier from this
# working tree as installed (/tmp/kvt: connectors/ -> kvtier/connectors, ...), then runs
# ./run gpu-test's steps with that python: tests/gpu, bench_copy.py, serve_bench.sh
# (BENCH=itl: itl_bench.sh instead, decode inter-token latency with and without stores;
# SKIP_TESTS=1 skips tests/gpu and bench_copy).
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
K=/tmp/kvt; rm -rf $K && mkdir -p $K
cp -r kvtier $K/kvtier && cp -r connectors $K/kvtier/connectors && cp -r indexer $K/kvtier/indexer \
  && cp -r router $K/kvtier/router && cp -r tests pyproject.toml $K/
export PYTHONPATH=$K:/tmp/site PYTHONUNBUFFERED=1
echo "== t=$(( $(date +%s) - T0 )) $(python3 -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__, torch.cuda.get_device_name())' 2>&1 | grep -v Warn | tail -1)"
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader; df -h /dev/shm | tail -1
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  echo "== t=$(( $(date +%s) - T0 )) tests/gpu"
  (cd $K && python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu 2>&1 | tee "$O/gpu-tests.txt")
  echo "== t=$(( $(date +%s) - T0 )) bench_copy"
  python3 benchmarks/gpu/bench_copy.py --out "$O/bench_copy.json" --reps ${REPS:-9}
fi
if [ "${BENCH:-serve}" = itl ]; then
  echo "== t=$(( $(date +%s) - T0 )) itl_bench"
  bash benchmarks/gpu/itl_bench.sh "$O" ${ITL_ARGS:-}
else
  echo "== t=$(( $(date +%s) - T0 )) serve_bench"
  bash benchmarks/gpu/serve_bench.sh "$O" "${LENGTHS:-3000,16000}" "${PROBE_REPS:-5}"
fi
echo "== t=$(( $(date +%s) - T0 )) end"
