#!/usr/bin/env bash
# Run on every node: NNODES nodes of GPUS_PER_NODE GPUs, rendezvous at MASTER (the address of node 0).
#   MASTER=10.0.0.1 NNODES=2 bash examples/launch/multinode.sh examples/gsm8k/task.yaml \
#       examples/gsm8k/models/qwen3-8b.yaml examples/gsm8k/algorithms/kl3.yaml model.hf_dir=/ckpt/Qwen3-8B
# Optional: GPUS_PER_NODE (8), PORT (29500), RUN_ID (megadiv; must be the same on every node),
# PYTHON (python3; the interpreter of the environment megadiv is installed in).
set -euo pipefail
: "${MASTER:?set MASTER to the address of node 0}" "${NNODES:?set NNODES to the number of nodes}"
exec "${PYTHON:-python3}" -m torch.distributed.run --nnodes "$NNODES" --nproc_per_node "${GPUS_PER_NODE:-8}" \
    --rdzv_backend c10d --rdzv_endpoint "$MASTER:${PORT:-29500}" --rdzv_id "${RUN_ID:-megadiv}" \
    -m megadiv.cli train "$@"
