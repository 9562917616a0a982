#!/usr/bin/env bash
# The run of train_grpo_sql_qwen7b_ray.sh (GRPO, SQL task, Qwen2.5-7B-Instruct, one 8-GPU
# node, configs/gpu_qwen7b_sql_1node.yaml), launched directly on the node without
# `ray job submit`: the driver runs in this shell.
#
# About the name: OpenRLHF 0.11.2 documents `deepspeed --module ...` launches only for its
# non-Ray trainers (openrlhf.cli.train_sft, train_rm, train_dpo). Its PPO/GRPO trainer
# (openrlhf.cli.train_ppo_ray, which war-train wraps) has no DeepSpeed-launcher form: the
# DeepSpeed ranks are Ray actors created by the driver, so the `deepspeed` command is never
# used. What OpenRLHF does show besides job submission is running the driver directly
# (`python3 -m openrlhf.cli.train_ppo_ray ...` on a node of the Ray cluster). This script is
# that variant: it starts a local Ray head if none is running, then runs war-train in the
# foreground.
#
# Usage (on the 8-GPU node):
#   bash scripts/install.sh
#   bash examples/scripts/train_grpo_sql_qwen7b_deepspeed.sh [war-train arguments...]
#   e.g. ... train_grpo_sql_qwen7b_deepspeed.sh --war.dispatch_policy least_loaded
#
# Environment: MODEL, DATA_DIR, SAVE_DIR, RUN_NAME and the dataset shape (TRAIN_DBS, ...)
# as in train_grpo_sql_qwen7b_ray.sh, which builds the dataset here if it is missing; and
#   NUM_GPUS  [8] GPUs for the Ray head this script starts
#   KEEP_RAY  [] set to 1 to leave that Ray head running afterwards (default: `ray stop`
#             when the run ends, only if this script started Ray)
# Differences from job submission: nothing is uploaded (every path is an absolute path in
# this checkout), the output goes to this terminal, and Ctrl-C ends the run. Environment
# variables reach the Ray workers only through the environment of `ray start`, so this
# script exports TOOL_FEEDBACK_FORMAT=chatml (the prompts use the chat template) before
# starting Ray. A Ray instance that was already running must have been started with it;
# otherwise use train_grpo_sql_qwen7b_ray.sh, which passes it with the job.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
VENV="${WAR_VENV:-$ROOT/.venv}"
[[ -x "$VENV/bin/python" ]] && export PATH="$VENV/bin:$PATH"

MODEL="${MODEL:-/models/Qwen2.5-7B-Instruct}"
DATA_DIR="${DATA_DIR:-$ROOT/data/sql_qa}"
SAVE_DIR="${SAVE_DIR:-$ROOT/runs/qwen7b_sql_1node}"
RUN_NAME="${RUN_NAME:-qwen7b_sql_grpo_$(date +%Y%m%dT%H%M)}"
NUM_GPUS="${NUM_GPUS:-8}"

die() { echo "train_grpo_sql_qwen7b_deepspeed.sh: $*" >&2; exit 1; }

command -v ray >/dev/null || die "ray not found: run bash scripts/install.sh first"
[[ -f "$MODEL/config.json" ]] || die "MODEL=$MODEL is not a local HF model directory; download it with
    hf download Qwen/Qwen2.5-7B-Instruct --local-dir $MODEL"
DATA_DIR="$DATA_DIR" bash "$HERE/train_grpo_sql_qwen7b_ray.sh" data
DATA_DIR="$(cd "$DATA_DIR" && pwd -P)"
mkdir -p "$SAVE_DIR"
SAVE_DIR="$(cd "$SAVE_DIR" && pwd -P)"

export TOOL_FEEDBACK_FORMAT=chatml
unset RAY_ADDRESS   # war-train's ray.init() attaches to this node's Ray instance
started=0
if ray status >/dev/null 2>&1; then
    echo "note: using the Ray instance already running on this node (it must have been started" \
         "with TOOL_FEEDBACK_FORMAT=chatml in its environment)" >&2
else
    (cd "$ROOT" && ray start --head --num-gpus "$NUM_GPUS")
    started=1
fi
cleanup() {
    if [[ "$started" == 1 && "${KEEP_RAY:-}" != 1 ]]; then ray stop; fi
}
trap cleanup EXIT

total="$(ray status 2>/dev/null | grep -oE '/[0-9.]+ GPU' | head -n 1 | tr -dc '0-9.' || true)"
if [[ -n "$total" ]] && (( ${total%.*} < 8 )); then
    die "Ray sees ${total%.*} GPUs; configs/gpu_qwen7b_sql_1node.yaml needs 8"
fi

cd "$ROOT"
python3 -m war_openrlhf.cli.train_ppo \
    --config "$ROOT/configs/gpu_qwen7b_sql_1node.yaml" \
    --actor.model_name_or_path "$MODEL" \
    --train.agent_func_path "$ROOT/examples/sql_qa/agent.py" \
    --data.prompt_dataset "$DATA_DIR/sql_train.jsonl" \
    --eval.dataset "$DATA_DIR/sql_eval.jsonl" \
    --ckpt.path "$SAVE_DIR/ckpt" \
    --ckpt.output_dir "$SAVE_DIR/model" \
    --logger.tensorboard_dir "$SAVE_DIR/tensorboard" \
    --logger.wandb.run_name "$RUN_NAME" \
    "$@"
echo "summary plot: python tools/plot_run.py --logdir $SAVE_DIR/tensorboard/$RUN_NAME --out $SAVE_DIR/$RUN_NAME.png"
