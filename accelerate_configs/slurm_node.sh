#!/bin/bash
# One node's part of accelerate_configs/slurm.sbatch: `srun` runs this once per node. It starts this node's
# `accelerate launch` (machine rank = SLURM_NODEID) and turns a preemption signal into a checkpoint.
#
# From the environment (slurm.sbatch sets the last two):
#   SLURM_NNODES, SLURM_NODEID       set by SLURM for every task
#   SLURM_GPUS_ON_NODE               set by SLURM with --gpus-per-node; processes per node (override: NPROC_PER_NODE)
#   MAIN_ADDR, MAIN_PORT             the rendezvous of node 0 (its hostname and a port)
#   ACCELERATE_CONFIG                default accelerate_configs/multinode_2x8.yaml
#   TRAIN_SCRIPT                     default train.py
#   MAX_RESTARTS                     default 3: a worker that dies restarts this node's group, which resumes from
#                                    the newest checkpoint (the other nodes' groups restart too: their collectives
#                                    fail); after 3 restarts the launcher gives up (docs/faults.md)
# Arguments: passed to the training script after `--resume latest`.
#
# Signals: SIGTERM or SIGUSR1 to this script is handed to the training processes as SIGTERM; they finish
# their step, checkpoint at the same step on every node and exit 0, so the launcher and this script exit 0.
# The launcher itself ignores SIGUSR1 (srun may deliver it to every process of the step; torch's launcher
# would die of it, leaving the workers to train on). SIGTERM to the launcher still checkpoints, but then
# the launcher exits 1 (docs/faults.md, "Why the launcher exits 1").
set -u

: "${SLURM_NNODES:?is not set: run this through srun (accelerate_configs/slurm.sbatch)}"
: "${SLURM_NODEID:?is not set: run this through srun (accelerate_configs/slurm.sbatch)}"
: "${MAIN_ADDR:?is not set: the hostname of node 0 (slurm.sbatch sets it)}"
: "${MAIN_PORT:?is not set: a free port on node 0 (slurm.sbatch sets it)}"

launch=(accelerate launch --config_file "${ACCELERATE_CONFIG:-accelerate_configs/multinode_2x8.yaml}"
        --num_machines "$SLURM_NNODES" --machine_rank "$SLURM_NODEID"
        --main_process_ip "$MAIN_ADDR" --main_process_port "$MAIN_PORT" --max_restarts "${MAX_RESTARTS:-3}")
per_node=${NPROC_PER_NODE:-${SLURM_GPUS_ON_NODE:-}}
if [ -n "$per_node" ]; then  # accelerate's --num_processes counts all nodes; without it the config's value holds
    launch+=(--num_processes "$((SLURM_NNODES * per_node))")
fi
launch+=("${TRAIN_SCRIPT:-train.py}" --resume latest "$@")

launcher=''
trap '[ -n "$launcher" ] && pkill -TERM -P "$launcher"' TERM USR1  # the launcher's children: the training processes
echo "node $SLURM_NODEID of $SLURM_NNODES ($(hostname)): ${launch[*]}"
( trap '' USR1; exec "${launch[@]}" ) &
launcher=$!
while kill -0 "$launcher" 2>/dev/null; do wait "$launcher"; done  # a trapped signal cuts a wait short
wait "$launcher"  # the launcher's own exit status (bash keeps it)
