#!/usr/bin/env bash
# Download, on this CPU machine, exactly the wheels the GPU verification machine's image lacks
# for tools/gpu_check.sh (cp312, manylinux x86_64, no dependencies), into .whl/ (git-ignored),
# print their total size and fail loudly over 64 MiB (what a device call may carry, the working
# tree included).
#
# The image (/work/.library/device/KINDS.md: Python 3.12.3, torch 2.11.0+cu130, transformers
# 5.17, numpy, packaging, pyyaml, safetensors, tokenizers 0.23.2, huggingface-hub 1.33, sympy,
# scipy, psutil, tensorboard, matplotlib, requests, pytest, pytest-timeout) lacks:
#   megatron-core 0.16.1      the model, its parallel layers and vocab_parallel_cross_entropy
#                             (needs torch, numpy, packaging: all there)
#   transformers 5.19.0       the version megadiv pins and was tested with (the image has 5.17;
#                             5.19's needs: huggingface-hub>=1.31, tokenizers 0.23: there)
#   math-verify 0.9.0, latex2sympy2_extended 1.11.0, antlr4-python3-runtime 4.13.2
#                             the math reward's verifier (sympy is there)
# Not carried, too large (docs/performance.md): Transformer Engine (276 MB core wheel), SGLang
# with its CUDA kernels (sgl-kernel 373 MB; needs torch 2.14.1).
set -euo pipefail
cd "$(dirname "$0")/.."
LIMIT=$((64 * 1024 * 1024))
WHEELS=(megatron-core==0.16.1 transformers==5.19.0 math-verify==0.9.0 latex2sympy2_extended==1.11.0
        antlr4-python3-runtime==4.13.2)
PY=${PYTHON:-python3}
rm -rf .whl
mkdir -p .whl
"$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d .whl "${WHEELS[@]}" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }
count=$(find .whl -maxdepth 1 -name "*.whl" | wc -l)
if [ "$count" -ne "${#WHEELS[@]}" ]; then
  echo "gpu_wheels: expected ${#WHEELS[@]} wheels in .whl/, found $count" >&2
  exit 1
fi
wheels=$(cat .whl/*.whl | wc -c)
# What else travels with a device call: tracked and untracked-not-ignored files.
tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 -r du -cb 2>/dev/null | tail -1 | cut -f1)
find .whl -maxdepth 1 -name "*.whl" -printf "  %10s  %f\n" | sort -k2
echo "gpu_wheels: .whl/ holds $count wheels, $wheels bytes ($((wheels / 1024 / 1024)) MiB); with the working tree ($tree bytes): $(((wheels + tree) / 1024 / 1024)) MiB of the 64 MiB a device call carries"
if [ $((wheels + tree)) -gt $LIMIT ]; then
  echo "gpu_wheels: ERROR: $((wheels + tree)) bytes exceed 64 MiB ($LIMIT bytes): the device call would be refused" >&2
  exit 1
fi
