#!/bin/bash
# Build the archives that carry vLLM 0.26.0 (CUDA) and its dependencies to a GPU machine
# without network (Python 3.12, torch 2.11.0+cu130 already there, as on the lent H200).
# Run from anywhere inside a kvtier checkout: bash benchmarks/gpu/pack.sh   (~4 min on 2 cores, mostly xz)
# Writes .gpu/c1, .gpu/c2, ... (each at most 52 MiB + the last one's small extras, so each fits
# one carry of 64 MiB together with the ~9 MiB working tree), then one more folder (.gpu/c4 with
# today's sizes) holding nixl.tar.xz: nixl==1.5.1 + nixl-cu13==1.5.1 (cp312 wheels, in .gpu/n)
# installed with pip --target and pruned (nixl_ep's torch 2.12-2.14 builds, scripts, headers,
# UCX perftest): ~17 MiB, small enough to travel with .gpu/c2 in one call. NixlConnector and
# kvtier's peer fetch need it; benchmarks/gpu/device.sh unpacks it into /tmp/nixlsite.
# PACK=nixl: only (re)build that last folder, keeping the vLLM folders already there.
# Adds /.gpu/ to .git/info/exclude. kvtier itself is NOT packed: it travels as source
# with the working tree, and benchmarks/gpu/device.sh puts it on PYTHONPATH.
# Needs pip with an index (PyPI) and xz.
set -euo pipefail
ROOT=$(git rev-parse --show-toplevel); cd "$ROOT"
grep -qx "/.gpu/" .git/info/exclude 2>/dev/null || echo "/.gpu/" >> .git/info/exclude
G=$ROOT/.gpu
PLAT="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64"

pack_vllm() {
D=$G/whl; rm -rf $D; SITE=$(mktemp -d); mkdir -p $D
# vllm and the dependencies a Llama/Qwen text model needs that the device image lacks
# (flashinfer, tilelang, z3, cutlass-dsl, mistral-common are not needed; run with VLLM_USE_FLASHINFER_SAMPLER=0).
PKGS="vllm==0.26.0 blake3==1.0.11 cachetools==8.0.2 cbor2==6.3.0 ijson==3.6.0 setproctitle==1.3.8 pybase64==1.5.1 partial-json-parser==0.2.1.1.post7 python-json-logger==4.2.0 watchfiles==1.3.0 msgspec==0.23.0 pyzmq==27.3.0 fastapi==0.136.3 starlette==1.10.0 uvicorn==0.54.0 python-multipart==0.0.34 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 openai==3.57.0 httpx2==2.16.2 httpcore2==2.16.2 jiter==0.19.0 sniffio==1.3.1 openai-harmony==0.0.8 prometheus-fastapi-instrumentator==8.1.0 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 depyf==0.20.0 astor==0.8.1 dill==0.4.1 compressed-tensors==0.17.0 loguru==0.7.3 lark==1.2.2 lm-format-enforcer==0.11.3 interegular==0.3.3 outlines-core==0.2.14 llguidance==1.7.6 xgrammar==0.2.7 apache-tvm-ffi==0.1.10 model-hosting-container-standards==0.1.16 jmespath==1.1.0 supervisor==4.3.0 opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2 opentelemetry-semantic-conventions-ai==0.5.1"
python3 -m pip download -q --no-deps $PLAT -d $D $PKGS
rm -rf $SITE && python3 -m pip install -q --no-deps --no-compile --target $SITE $PLAT $D/*.whl
cd $SITE
# prune: FA2 (FA3 is used on sm90), the optional Rust frontend, JIT headers, other-Python deep_gemm builds
rm -rf bin vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so vllm/vllm-rs vllm/third_party/deep_gemm/include \
       vllm/third_party/fmha_sm100/cutlass vllm/third_party/deep_gemm/_C.cpython-31[0134]-x86_64-linux-gnu.so
find . -name __pycache__ -prune -exec rm -rf {} +
tar -cf - --exclude=vllm/_moe_C_stable_libtorch.abi3.so . | xz -9 -T0 > $SITE.nomoe.tar.xz
tar -cf - vllm/_moe_C_stable_libtorch.abi3.so | xz -9 -T0 > $SITE.moe.tar.xz
# One folder per carry: the device tool carries at most 64 MiB with the working tree (~8 MiB).
rm -rf $G/c[0-9]* $G/parts && mkdir -p $G/parts
split -b ${CHUNK:-52m} -d -a 1 $SITE.nomoe.tar.xz $G/parts/site.part-
i=0; for f in $G/parts/site.part-*; do i=$((i+1)); mkdir -p $G/c$i; mv $f $G/c$i/; done
i=$((i+1)); mkdir -p $G/c$i; cp $SITE.moe.tar.xz $G/c$i/moe.tar.xz   # ~39 MiB on its own
sha256sum $SITE.nomoe.tar.xz $SITE.moe.tar.xz | awk '{print $1}' > $G/c$i/sums.txt
rm -rf $D $G/parts
ls -l $G/c*
rm -rf "$SITE" "$SITE.nomoe.tar.xz" "$SITE.moe.tar.xz"
}

# nixl: next folder after the vLLM ones (the one holding sums.txt)
pack_nixl() {
  local last n N S
  last=$(ls -d $G/c[0-9]* 2>/dev/null | while read -r d; do [ -f $d/sums.txt ] && basename $d; done | sort -V | tail -1)
  [ -n "$last" ] || { echo "no vLLM folders under $G (run without PACK=nixl first)" >&2; exit 1; }
  n=$(( ${last#c} + 1 )); N=$G/n
  mkdir -p $N
  ls $N/nixl-1.5.1-*.whl $N/nixl_cu13-1.5.1-*.whl >/dev/null 2>&1 || \
    python3 -m pip download -q --no-deps --python-version 3.12 --only-binary :all: --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 -d $N nixl==1.5.1 nixl-cu13==1.5.1
  S=$(mktemp -d)
  python3 -m pip install -q --no-deps --no-compile --target $S $PLAT $N/nixl-1.5.1-*.whl $N/nixl_cu13-1.5.1-*.whl
  (cd $S && rm -rf bin include nixl_ep_cu13/*.so nixl_cu13.libs/ucx/libucx_perftest* \
     && find . -name __pycache__ -prune -exec rm -rf {} + && tar -cf - . | xz -9 -T0 > $S.tar.xz)
  rm -rf $G/c$n && mkdir -p $G/c$n && mv $S.tar.xz $G/c$n/nixl.tar.xz
  sha256sum $G/c$n/nixl.tar.xz | awk '{print $1}' > $G/c$n/nixl.sum
  rm -rf "$S"; ls -l $G/c$n
}

[ "${PACK:-all}" = nixl ] || pack_vllm
pack_nixl
