#!/usr/bin/env bash
# Run on every node: NNODES nodes of GPUS_PER_NODE GPUs, rendezvous at MASTER (the address of node 0).
#   MASTER=10.0.0.1 NNODES=2 bash examples/launch/multinode.sh examples/gsm8k/task.yaml \
#       examples/gsm8k/models/qwen3-8b.yaml examples/gsm8k/algorithms/kl3.yaml model.hf_dir=/ckpt/Qwen3-8B
# Optional: GPUS_PER_NODE (8), PORT (29500), RUN_ID (megadiv; must be the same on every node),
# PYTHON (python3; the interpreter of the environment megadiv is installed in).
# Faults (docs/scaling.md, Faults): MAX_RESTARTS (3): after a rank, a node or a launcher fails, the
# surviving launchers stop their ranks, rendezvous again and start them afresh, which resume from
# the newest intact checkpoint (an attempt that wrote no checkpoint is not retried). MIN_NODES
# (NNODES): fewer nodes the job may go on with (torchrun's elastic --nnodes MIN_NODES:NNODES; the
# checkpoint resumes at the smaller data-parallel size, which must exist: nodes x GPUs a multiple of
# TP x PP with the batch splitting over the new DP, else the resume is refused, e.g. never for the
# 32B recipes at 2 or 4 nodes: docs/scaling.md); with MIN_NODES=NNODES the launchers wait
# for a replacement node (a launcher started again with the same RUN_ID) as long as the
# rendezvous allows (RDZV_TIMEOUT, 900 s: also how long an agent waits on the others' rendezvous
# records, torchrun's read_timeout, 60 s by default, which a slow node's restart can pass). Node 0 hosts the rendezvous: the job ends with it.
set -euo pipefail
: "${MASTER:?set MASTER to the address of node 0}" "${NNODES:?set NNODES to the number of nodes}"
# Rank 0's agent publishes the ranks' MASTER_ADDR/PORT anew in every rendezvous round. With the
# rendezvous store shared with the ranks (torch's default), an agent keeps the first round's
# address: one that was group rank 0 and is again never publishes it for the new round, and a
# replacement node waits for it until read_timeout (seen: tests/test_launch.py's killed-node run
# hung whenever the surviving launcher had been rank 0).
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
exec "${PYTHON:-python3}" -m torch.distributed.run --nnodes "${MIN_NODES:-$NNODES}:$NNODES" \
    --nproc_per_node "${GPUS_PER_NODE:-8}" --max-restarts "${MAX_RESTARTS:-3}" \
    --rdzv_backend c10d --rdzv_endpoint "$MASTER:${PORT:-29500}" --rdzv_id "${RUN_ID:-megadiv}" \
    --rdzv_conf "join_timeout=${RDZV_TIMEOUT:-900},read_timeout=${RDZV_TIMEOUT:-900}" \
    -m megadiv.cli train "$@"
