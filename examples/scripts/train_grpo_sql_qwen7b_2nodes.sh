#!/usr/bin/env bash
# GRPO on the SQL task (examples/sql_qa) with Qwen2.5-7B-Instruct on two 8-GPU nodes
# (configs/gpu_qwen7b_sql_2node.yaml): the actor (8 ZeRO-3 ranks, reference model colocated)
# fills one node, 8 WAR engines fill the other. This script starts the Ray cluster and submits
# the job; the data and the submission are those of train_grpo_sql_qwen7b_ray.sh.
#
# Usage, in this order (the same repository checkout path on both nodes, installed on each
# with `bash scripts/install.sh`):
#   node 0:  bash examples/scripts/train_grpo_sql_qwen7b_2nodes.sh head
#   node 1:  HEAD_IP=<node 0 address> bash examples/scripts/train_grpo_sql_qwen7b_2nodes.sh worker
#   both:    bash examples/scripts/train_grpo_sql_qwen7b_2nodes.sh data   # once, on a shared
#            DATA_DIR; or on each node with the same local DATA_DIR (deterministic output)
#   node 0:  bash examples/scripts/train_grpo_sql_qwen7b_2nodes.sh submit [war-train arguments...]
#
# What head and worker run (to start Ray by hand, from the project's venv: Ray workers run the
# Python that started Ray on their node, which must have vllm, openrlhf and war_openrlhf):
#   node 0:  ray start --head --node-ip-address $HEAD_IP --port 6379 --num-gpus 8
#   node 1:  ray start --address $HEAD_IP:6379 --num-gpus 8
#   then `ray status` shows 16 GPUs. `ray stop` on each node tears the cluster down.
# The dashboard (job API) listens on node 0's 127.0.0.1:8265, so submit from node 0; add
# --dashboard-host 0.0.0.0 to the head's command to submit from elsewhere (this exposes the
# job API to the network).
#
# Environment: everything train_grpo_sql_qwen7b_ray.sh reads (MODEL, DATA_DIR, SAVE_DIR,
# RUN_NAME, RAY_ADDRESS, JOB_ENV, NO_WAIT, TRAIN_DBS, ...), with these defaults changed:
#   SAVE_DIR   [<repo>/runs/qwen7b_sql_2node]   RUN_NAME [qwen7b_sql_grpo_2node_<date>]
# and:
#   HEAD_IP        [head: this node's first address from `hostname -I`; worker: required]
#   RAY_PORT       [6379] the head's GCS port
#   GPUS_PER_NODE  [8]
# Paths on two nodes: MODEL is read on both nodes; DATA_DIR is read by the trainer process
# and SAVE_DIR written by it and by the actor, and Ray may place either on either node. So
# all three must name the same files everywhere: a shared file system (recommended for
# SAVE_DIR), or identical local copies at the same absolute path (fine for MODEL and DATA_DIR).
# Cross-node NCCL (the weight broadcast after each step) may need the network interface named,
# e.g. JOB_ENV="NCCL_SOCKET_IFNAME=eth0" (or NCCL_IB_HCA=... on InfiniBand).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
VENV="${WAR_VENV:-$ROOT/.venv}"
[[ -x "$VENV/bin/python" ]] && export PATH="$VENV/bin:$PATH"
RAY_PORT="${RAY_PORT:-6379}"
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"

die() { echo "train_grpo_sql_qwen7b_2nodes.sh: $*" >&2; exit 1; }

cmd="${1:-}"
[[ $# -gt 0 ]] && shift
case "$cmd" in
    head)
        command -v ray >/dev/null || die "ray not found: run bash scripts/install.sh on this node first"
        HEAD_IP="${HEAD_IP:-$(hostname -I | awk '{print $1}')}"
        [[ -n "$HEAD_IP" ]] || die "could not find this node's address; set HEAD_IP"
        ray start --head --node-ip-address "$HEAD_IP" --port "$RAY_PORT" --num-gpus "$GPUS_PER_NODE"
        echo "head started; on the other node run:"
        echo "  HEAD_IP=$HEAD_IP bash examples/scripts/train_grpo_sql_qwen7b_2nodes.sh worker"
        ;;
    worker)
        command -v ray >/dev/null || die "ray not found: run bash scripts/install.sh on this node first"
        [[ -n "${HEAD_IP:-}" ]] || die "set HEAD_IP to node 0's address (the one the head printed)"
        ray start --address "$HEAD_IP:$RAY_PORT" --num-gpus "$GPUS_PER_NODE"
        ;;
    data)
        exec bash "$HERE/train_grpo_sql_qwen7b_ray.sh" data
        ;;
    submit)
        CONFIG=configs/gpu_qwen7b_sql_2node.yaml \
        NUM_GPUS=$((2 * GPUS_PER_NODE)) \
        SAVE_DIR="${SAVE_DIR:-$ROOT/runs/qwen7b_sql_2node}" \
        RUN_NAME="${RUN_NAME:-qwen7b_sql_grpo_2node_$(date +%Y%m%dT%H%M)}" \
            exec bash "$HERE/train_grpo_sql_qwen7b_ray.sh" submit "$@"
        ;;
    -h|--help|"")
        sed -n '2,/^set -euo/p' "$0" | sed '$d'
        [[ -n "$cmd" ]] || exit 2
        ;;
    *)
        die "unknown command '$cmd' (head, worker, data or submit)"
        ;;
esac
