#!/usr/bin/env bash
# Gather, on this CPU machine, exactly the wheels the GPU verification machine's image lacks for
# tools/gpu_check.sh (cp312, manylinux x86_64, no dependencies) into .whl/ (git-ignored; or DEST),
# list them with their total, and fail loudly over 64 MiB (what a device call may carry, the
# working tree included):
#   bash tools/gpu_wheels.sh [--dest DIR]
# Downloads and the DeepSpeed build are cached in $MEGADIV_CACHE/gpu-wheels (default
# ~/.cache/megadiv): a second run needs no network. Python: $PYTHON, else .venv's, else python3.
#
# The verification machine's image (as described for it: Python 3.12.3, torch 2.11.0+cu130, transformers
# 5.17, numpy, packaging, pyyaml, safetensors, tokenizers 0.23.2, huggingface-hub 1.33, sympy,
# scipy, psutil, tensorboard, matplotlib, requests, pytest, pytest-timeout, einops, msgpack, ninja,
# py-cpuinfo, tqdm) lacks:
#   megatron-core 0.16.1      the model, its parallel layers and vocab_parallel_cross_entropy
#                             (needs torch, numpy, packaging: all there)
#   transformers 5.19.0       the version megadiv pins and was tested with (the image has 5.17;
#                             5.19's needs: huggingface-hub>=1.31, tokenizers 0.23: there)
#   math-verify 0.9.0, latex2sympy2_extended 1.11.0, antlr4-python3-runtime 4.13.2
#                             the math reward's verifier (sympy is there)
#   deepspeed 0.19.8          built here as a pure-Python wheel (DS_BUILD_OPS=0: no compiled ops;
#                             on the GPU its fused Adam JIT-compiles with the image's nvcc)
#   hjson 3.1.0, pydantic 2.14.4, pydantic-core 2.50.5, annotated-types 0.8.0,
#   typing-inspection 0.4.5, typing-extensions 4.16.0
#                             DeepSpeed's config needs (its others, einops, msgpack, ninja,
#                             py-cpuinfo, psutil, tqdm, are in the image); pydantic 2.14 asks
#                             typing-extensions >= 4.16
# Not carried, too large (docs/performance.md): Transformer Engine (276 MB core wheel), SGLang
# with its CUDA kernels (sgl-kernel 373 MB; needs torch 2.14.1).
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=.whl
if [ "${1:-}" = "--dest" ] && [ -n "${2:-}" ]; then DEST=$2
elif [ $# -gt 0 ]; then echo "usage: bash tools/gpu_wheels.sh [--dest DIR]" >&2; exit 2
fi
LIMIT=$((64 * 1024 * 1024))
DOWNLOADED=(megatron-core==0.16.1 transformers==5.19.0 math-verify==0.9.0 latex2sympy2_extended==1.11.0
            antlr4-python3-runtime==4.13.2 hjson==3.1.0 pydantic==2.14.4 pydantic-core==2.50.5
            annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0)
BUILT=deepspeed==0.19.8
CACHE=${MEGADIV_CACHE:-$HOME/.cache/megadiv}/gpu-wheels
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x .venv/bin/python ]; then PY=.venv/bin/python
else PY=python3
fi
mkdir -p "$CACHE"
shopt -s nocaseglob nullglob

cached() {   # the cached wheel of NAME==VERSION (wheel names spell - and . as _), or nothing
  local name=${1%%==*} version=${1##*==}
  local files=("$CACHE/${name//[-.]/_}-$version-"*.whl)
  [ ${#files[@]} -gt 0 ] && echo "${files[0]}"
}

missing=()
for spec in "${DOWNLOADED[@]}"; do [ -n "$(cached "$spec")" ] || missing+=("$spec"); done
if [ ${#missing[@]} -gt 0 ]; then
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    -d "$CACHE" "${missing[@]}" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }
fi
if [ -z "$(cached "$BUILT")" ]; then
  echo "gpu_wheels: building $BUILT (DS_BUILD_OPS=0, no compiled ops) into $CACHE"
  DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$CACHE" "$BUILT" 2>&1 \
    | { grep -v "is ignored: it is neither a file nor a directory" || true; }
fi

rm -rf "$DEST"
mkdir -p "$DEST"
for spec in "${DOWNLOADED[@]}" "$BUILT"; do
  file=$(cached "$spec")
  if [ -z "$file" ]; then
    echo "gpu_wheels: no wheel for $spec in $CACHE (download or build failed above)" >&2
    exit 1
  fi
  cp "$file" "$DEST/"
done
# count files only: a folder whose name ends in .whl (the destination itself) is not a wheel
count=$(find "$DEST" -maxdepth 1 -type f -name "*.whl" | wc -l)
expected=$(( ${#DOWNLOADED[@]} + 1 ))
if [ "$count" -ne "$expected" ]; then
  echo "gpu_wheels: expected $expected wheels in $DEST, found $count" >&2
  exit 1
fi
wheels=$(find "$DEST" -maxdepth 1 -type f -name "*.whl" -printf "%s\n" | awk '{s += $1} END {print s}')
# What else travels with a device call: tracked and untracked-not-ignored files.
tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 -r du -cb 2>/dev/null | awk '$2 == "total" {s += $1} END {print s + 0}')
find "$DEST" -maxdepth 1 -type f -name "*.whl" -printf "  %10s  %f\n" | sort -k2
echo "gpu_wheels: $DEST holds $count wheels, $wheels bytes ($((wheels / 1024 / 1024)) MiB); with the working tree ($tree bytes): $(((wheels + tree) / 1024 / 1024)) MiB of the 64 MiB a device call carries"
if [ $((wheels + tree)) -gt $LIMIT ]; then
  echo "gpu_wheels: ERROR: $((wheels + tree)) bytes exceed 64 MiB ($LIMIT bytes): the device call would be refused" >&2
  exit 1
fi
