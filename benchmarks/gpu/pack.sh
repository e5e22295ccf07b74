#!/bin/bash
# Build the folders that carry vLLM 0.26.0 (CUDA), its dependencies and NIXL to a GPU machine
# without network (Python 3.12, torch 2.11.0+cu130 already there, as on the lent H100/H200).
# Run from anywhere inside a kvtier checkout, a fresh clone included:
#   bash benchmarks/gpu/pack.sh        (~5 min on 2 cores: the download, then mostly xz)
# Three archives are built in temporary folders, then split and packed into .gpu/c1 .. .gpu/cN:
#   site.tar.xz  vllm==0.26.0 + the dependencies a Llama/Qwen text model needs (pruned)
#   moe.tar.xz   vLLM's MoE kernels (one big .so, kept apart so the site archive stays small)
#   nixl.tar.xz  nixl==1.5.1 + nixl-cu13==1.5.1, pruned (nixl_ep's torch builds, headers, perftest);
#                NixlConnector and kvtier's peer fetch need it
# Each .gpu/cK holds at most CHUNK bytes (default: 56 MiB less the working tree that travels with
# every call, since the device tool carries 64 MiB in all, and 8 MiB for the tree to grow between
# packing and the calls: a 62 MiB budget failed to carry once the results of a session were
# committed), so each is one `run` call's carry.
# Every folder also holds sums.txt (sha256 of each whole archive); benchmarks/gpu/device.sh joins the
# parts, checks the sums and unpacks. Downloaded wheels stay in .gpu/whl (a rerun skips the download).
# Adds /.gpu/ to .git/info/exclude. kvtier itself is NOT packed: it travels as source with the
# working tree, and device.sh puts it on PYTHONPATH. Needs python3 with pip, an index (PyPI) and xz.
# XZ_LEVEL (default -9): -3 is several times faster on a busy machine, its folders ~15 % larger.
set -euo pipefail
ROOT=$(git rev-parse --show-toplevel); cd "$ROOT"
mkdir -p .git/info
grep -qx "/.gpu/" .git/info/exclude 2>/dev/null || echo "/.gpu/" >> .git/info/exclude
G=$ROOT/.gpu; W=$G/whl; mkdir -p "$W"
PLAT="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64"
# vllm and the dependencies a Llama/Qwen text model needs that the device image lacks
# (flashinfer, tilelang, z3, cutlass-dsl, mistral-common are not needed; run with VLLM_USE_FLASHINFER_SAMPLER=0).
PKGS="vllm==0.26.0 blake3==1.0.11 cachetools==8.0.2 cbor2==6.3.0 ijson==3.6.0 setproctitle==1.3.8 pybase64==1.5.1 partial-json-parser==0.2.1.1.post7 python-json-logger==4.2.0 watchfiles==1.3.0 msgspec==0.23.0 pyzmq==27.3.0 fastapi==0.136.3 starlette==1.10.0 uvicorn==0.54.0 python-multipart==0.0.34 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 openai==3.57.0 httpx2==2.16.2 httpcore2==2.16.2 jiter==0.19.0 sniffio==1.3.1 openai-harmony==0.0.8 prometheus-fastapi-instrumentator==8.1.0 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 depyf==0.20.0 astor==0.8.1 dill==0.4.1 compressed-tensors==0.17.0 loguru==0.7.3 lark==1.2.2 lm-format-enforcer==0.11.3 interegular==0.3.3 outlines-core==0.2.14 llguidance==1.7.6 xgrammar==0.2.7 apache-tvm-ffi==0.1.10 model-hosting-container-standards==0.1.16 jmespath==1.1.0 supervisor==4.3.0 opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2 opentelemetry-semantic-conventions-ai==0.5.1"
NIXL="nixl==1.5.1 nixl-cu13==1.5.1"
TMP=$(mktemp -d); trap 'rm -rf "$TMP"' EXIT
python3 -m pip download -q --no-deps $PLAT -d "$W" $PKGS $NIXL

# Every step below runs in a subshell that cds into a temp folder, so this shell's cwd stays the
# checkout (a deleted cwd breaks pip and the later steps).
mkdir -p "$TMP/site" "$TMP/nixl" "$TMP/out"
python3 -m pip install -q --no-deps --no-compile --target "$TMP/site" $PLAT $(ls "$W"/*.whl | grep -v -E '/nixl')
( cd "$TMP/site"
  # prune: FA2 (FA3 is used on sm90), the optional Rust frontend, JIT headers, other-Python deep_gemm builds
  rm -rf bin vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so vllm/vllm-rs vllm/third_party/deep_gemm/include \
         vllm/third_party/fmha_sm100/cutlass vllm/third_party/deep_gemm/_C.cpython-31[0134]-x86_64-linux-gnu.so
  find . -name __pycache__ -prune -exec rm -rf {} +
  tar -cf - --exclude=vllm/_moe_C_stable_libtorch.abi3.so . | xz ${XZ_LEVEL:--9} -T0 > "$TMP/out/site.tar.xz"
  tar -cf - vllm/_moe_C_stable_libtorch.abi3.so | xz ${XZ_LEVEL:--9} -T0 > "$TMP/out/moe.tar.xz" )
python3 -m pip install -q --no-deps --no-compile --target "$TMP/nixl" $PLAT "$W"/nixl-1.5.1-*.whl "$W"/nixl_cu13-1.5.1-*.whl
( cd "$TMP/nixl" && rm -rf bin include nixl_ep_cu13/*.so nixl_cu13.libs/ucx/libucx_perftest* \
  && find . -name __pycache__ -prune -exec rm -rf {} + && tar -cf - . | xz ${XZ_LEVEL:--9} -T0 > "$TMP/out/nixl.tar.xz" )

# Split into parts and fill folders in order, each at most CHUNK bytes.
TREE=$(git ls-files -z --cached --others --exclude-standard | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
CHUNK=${CHUNK:-$(( 56 * 1048576 - TREE ))}
echo "working tree $TREE B; chunk $CHUNK B"
(cd "$TMP/out" && sha256sum site.tar.xz moe.tar.xz nixl.tar.xz > sums.txt)
mkdir -p "$TMP/parts"
for a in site moe nixl; do split -b "$CHUNK" -d -a 2 "$TMP/out/$a.tar.xz" "$TMP/parts/$a.part-"; done
rm -rf "$G"/c[0-9]*
i=1; used=0; mkdir -p "$G/c1"
for f in "$TMP"/parts/site.part-* "$TMP"/parts/moe.part-* "$TMP"/parts/nixl.part-*; do
  s=$(stat -c %s "$f")
  if [ $(( used + s )) -gt "$CHUNK" ]; then i=$((i+1)); used=0; mkdir -p "$G/c$i"; fi
  mv "$f" "$G/c$i/"; used=$(( used + s ))
done
for d in "$G"/c[0-9]*; do cp "$TMP/out/sums.txt" "$d/"; done
du -sh "$G"/c[0-9]*; ls "$G"/c[0-9]*
