#!/usr/bin/env bash
# The prepared GPU verification run (tools/gpu_check.py says what it checks):
#   bash tools/gpu_check.sh OUT_DIR [--only ITEM,ITEM] [--budget SECONDS] [--smoke]
# writes OUT_DIR/gpu_check.json and OUT_DIR/gpu_check.log. Runs anywhere: without CUDA every GPU
# item is reported as skipped. Python: $PYTHON, else the repository's .venv, else python3 (the
# GPU machine's interpreter with torch). Exit: 0 no item failed, 1 some item failed, 2 usage.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
if [ $# -lt 1 ] || [[ "$1" == -* ]]; then
  echo "usage: bash tools/gpu_check.sh OUT_DIR [--only ITEM,ITEM] [--budget SECONDS] [--smoke]" >&2
  exit 2
fi
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x .venv/bin/python ]; then PY=.venv/bin/python
else PY=python3
fi
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" -u tools/gpu_check.py "$@"
