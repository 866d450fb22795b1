#!/usr/bin/env bash
# Build (or refresh) the CPU-tier virtual environment at .venv in the repository root.
# Idempotent: a second run checks a stamp of the requirement files and returns in seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv
PY=${PYTHON:-python3}
stamp_src=$(cat requirements-cpu.txt requirements-sglang-cpu.txt tools/setup_env.sh setup.py | sha256sum | cut -d' ' -f1)
if [ -f "$VENV/.megadiv-stamp" ] && [ "$(cat "$VENV/.megadiv-stamp")" = "$stamp_src" ]; then
  echo "[setup] $VENV is up to date"
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
# pip, without the find-links notices this machine's pip configuration prints for every package
pip() { "$VENV/bin/python" -m pip "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }; }
pip install -q --upgrade pip setuptools wheel
echo "[setup] torch 2.13.0 (CPU build)"
pip install -q torch==2.13.0
echo "[setup] megadiv CPU tier"
pip install -q -r requirements-cpu.txt
echo "[setup] deepspeed (no compiled ops)"
DS_BUILD_OPS=0 pip install -q "deepspeed==0.19.8"
# DeepSpeed's CPU backend JIT-builds its shared-memory comm op (into ~/.cache/torch_extensions) the
# first time any engine starts; build it here, once, not inside a test's timeout (minutes on 2 cores).
"$VENV/bin/python" -c "from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder; ShareMemCommBuilder().load()"
echo "[setup] sglang 0.5.23 CPU tier (no CUDA dependencies)"
pip install -q -r requirements-sglang-cpu.txt
pip install -q --no-deps sglang==0.5.23
pip install -q --no-deps -e .
echo "$stamp_src" > "$VENV/.megadiv-stamp"
echo "[setup] done: $VENV"
