#!/usr/bin/env bash
# GRPO on the SQL task (examples/sql_qa) with Qwen2.5-7B-Instruct on one 8-GPU node:
# builds the dataset if it is missing, then submits `war-train --config
# configs/gpu_qwen7b_sql_1node.yaml` as a job to a running Ray cluster (OpenRLHF's
# `ray job submit` style). Rollouts run on 4 WAR engines; the actor and the reference
# model share the other 4 GPUs.
#
# Usage:
#   bash scripts/install.sh && source .venv/bin/activate     # on the node, once
#   ray start --head --num-gpus 8                            # on the node, from the activated venv
#   bash examples/scripts/train_grpo_sql_qwen7b_ray.sh [all|data|submit] [war-train arguments...]
#
#     all (default)  data, then submit
#     data           only build the dataset and the SQLite databases in $DATA_DIR
#     submit         only submit the job (the data must exist)
#   Extra arguments go to war-train after the config and win over it, e.g.
#     bash examples/scripts/train_grpo_sql_qwen7b_ray.sh submit --war.engine.speculation off
#
# Environment (defaults in brackets):
#   MODEL      [/models/Qwen2.5-7B-Instruct] local HF model directory, at this path on every
#              node (WAR engines load a directory). Get it with
#              hf download Qwen/Qwen2.5-7B-Instruct --local-dir "$MODEL"
#   DATA_DIR   [<repo>/data/sql_qa] training/eval JSONL and the SQLite files they name. The
#              labels hold absolute database paths, so DATA_DIR must be readable at the same
#              absolute path wherever the trainer runs (on one node: this node)
#   SAVE_DIR   [<repo>/runs/qwen7b_sql_1node] checkpoints (ckpt/), final HF model (model/),
#              TensorBoard logs (tensorboard/<RUN_NAME>/)
#   RUN_NAME   [qwen7b_sql_grpo_<date>] TensorBoard run directory name
#   RAY_ADDRESS [http://127.0.0.1:8265] the Ray dashboard (job API) of the cluster
#   CONFIG     [configs/gpu_qwen7b_sql_1node.yaml] relative to the repository root
#   NUM_GPUS   [8] GPUs the config needs; checked against `ray status` when it can be read
#   JOB_ENV    [] extra KEY=VALUE pairs for every job process, e.g. "NCCL_SOCKET_IFNAME=eth0"
#   NO_WAIT    [] set to 1 to return after submitting (then: ray job logs -f <id>)
#   TRAIN_DBS [32] N_PER_DB [128] N_EVAL [128] EVAL_DB_SEED [1000]  dataset shape: TRAIN_DBS
#              databases (db seeds 0..TRAIN_DBS-1) with N_PER_DB questions each for training,
#              N_EVAL questions over a held-out database (seed EVAL_DB_SEED) for evaluation
#
# The repository is the job's working_dir: Ray uploads it (minus .gitignore'd files) and
# every job process runs in its copy, so the config and the agent file need not exist on
# the other nodes; the model, DATA_DIR and SAVE_DIR are passed as absolute paths.
# Ctrl-C stops following the logs, not the job: `ray job stop <id>`.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
VENV="${WAR_VENV:-$ROOT/.venv}"
[[ -x "$VENV/bin/python" ]] && export PATH="$VENV/bin:$PATH"
PY="${PYTHON:-python3}"

MODEL="${MODEL:-/models/Qwen2.5-7B-Instruct}"
DATA_DIR="${DATA_DIR:-$ROOT/data/sql_qa}"
SAVE_DIR="${SAVE_DIR:-$ROOT/runs/qwen7b_sql_1node}"
RUN_NAME="${RUN_NAME:-qwen7b_sql_grpo_$(date +%Y%m%dT%H%M)}"
RAY_ADDRESS="${RAY_ADDRESS:-http://127.0.0.1:8265}"
CONFIG="${CONFIG:-configs/gpu_qwen7b_sql_1node.yaml}"
NUM_GPUS="${NUM_GPUS:-8}"
JOB_ENV="${JOB_ENV:-}"
TRAIN_DBS="${TRAIN_DBS:-32}"
N_PER_DB="${N_PER_DB:-128}"
N_EVAL="${N_EVAL:-128}"
EVAL_DB_SEED="${EVAL_DB_SEED:-1000}"

die() { echo "train_grpo_sql_qwen7b_ray.sh: $*" >&2; exit 1; }

abspath() { mkdir -p "$1" && (cd "$1" && pwd -P); }

prepare_data() {
    DATA_DIR="$(abspath "$DATA_DIR")"
    local stamp="$DATA_DIR/.dataset_params"
    local params="dir=$DATA_DIR train_dbs=$TRAIN_DBS n_per_db=$N_PER_DB n_eval=$N_EVAL eval_db_seed=$EVAL_DB_SEED"
    if [[ -s "$DATA_DIR/sql_train.jsonl" && -s "$DATA_DIR/sql_eval.jsonl" && -f "$stamp" \
          && "$(cat "$stamp")" == "$params" ]]; then
        echo "data: $DATA_DIR is ready ($params)"
        return
    fi
    (( EVAL_DB_SEED >= TRAIN_DBS )) || die "EVAL_DB_SEED=$EVAL_DB_SEED must not be a training database seed (0..$((TRAIN_DBS - 1)))"
    echo "data: building $TRAIN_DBS x $N_PER_DB training + $N_EVAL eval questions in $DATA_DIR"
    local tmp s
    tmp="$(mktemp -d "$DATA_DIR/.build.XXXXXX")"
    # One database per seed; question seed = database seed, so every file is reproducible
    # (running this again, on any node, writes the same bytes).
    for ((s = 0; s < TRAIN_DBS; s++)); do
        "$PY" "$ROOT/examples/sql_qa/dataset.py" --out "$tmp/train_$(printf %04d "$s").jsonl" \
            --n "$N_PER_DB" --seed "$s" --db-seed "$s" --db "$DATA_DIR/shop_db$s.sqlite" >/dev/null
    done
    cat "$tmp"/train_*.jsonl > "$tmp/sql_train.jsonl"
    "$PY" "$ROOT/examples/sql_qa/dataset.py" --out "$tmp/sql_eval.jsonl" --n "$N_EVAL" \
        --seed "$EVAL_DB_SEED" --db-seed "$EVAL_DB_SEED" --db "$DATA_DIR/shop_db$EVAL_DB_SEED.sqlite" >/dev/null
    mv -f "$tmp/sql_train.jsonl" "$DATA_DIR/sql_train.jsonl"
    mv -f "$tmp/sql_eval.jsonl" "$DATA_DIR/sql_eval.jsonl"
    rm -rf "$tmp"
    echo "$params" > "$stamp"
    echo "data: $(wc -l < "$DATA_DIR/sql_train.jsonl") training rows, $(wc -l < "$DATA_DIR/sql_eval.jsonl") eval rows"
}

check_gpus() {
    # Best effort: `ray status` answers only on a cluster node; elsewhere the check is skipped.
    local total
    total="$(env -u RAY_ADDRESS ray status 2>/dev/null | grep -oE '/[0-9.]+ GPU' | head -n 1 | tr -dc '0-9.' || true)"
    if [[ -n "$total" ]] && (( ${total%.*} < NUM_GPUS )); then
        die "the Ray cluster has ${total%.*} GPUs, $CONFIG needs $NUM_GPUS (the job would wait for them forever)"
    fi
}

submit() {
    command -v ray >/dev/null || die "ray not found: activate the environment (source .venv/bin/activate)"
    [[ -f "$MODEL/config.json" ]] || die "MODEL=$MODEL is not a local HF model directory; download it with
    hf download Qwen/Qwen2.5-7B-Instruct --local-dir $MODEL"
    DATA_DIR="$(abspath "$DATA_DIR")"
    [[ -s "$DATA_DIR/sql_train.jsonl" && -s "$DATA_DIR/sql_eval.jsonl" ]] \
        || die "no dataset in $DATA_DIR; run: bash $0 data"
    [[ -f "$ROOT/$CONFIG" ]] || die "CONFIG=$CONFIG: no such file under $ROOT"
    SAVE_DIR="$(abspath "$SAVE_DIR")"
    check_gpus

    # The runtime environment: the repository as working_dir, without the data, model and
    # output directories when they sit inside it (they are read/written by absolute path);
    # TOOL_FEEDBACK_FORMAT=chatml because the prompts use the chat template
    # (data.apply_chat_template); RAY_OVERRIDE_JOB_RUNTIME_ENV=1 lets war-train's own ray.init
    # env_vars (NCCL_DEBUG, TOKENIZERS_PARALLELISM, ...) merge with the job's even when JOB_ENV
    # names the same variables.
    local runtime_env
    runtime_env="$("$PY" - "$ROOT" "$DATA_DIR" "$SAVE_DIR" "$MODEL" "$JOB_ENV" <<'PY'
import json, os, sys
root, data, save, model, extra = sys.argv[1:]
excludes = []
for p in (data, save, model):
    rel = os.path.relpath(os.path.realpath(p), os.path.realpath(root))
    if not rel.startswith(".."):
        excludes.append(rel.rstrip("/") + "/")
env = {"TOOL_FEEDBACK_FORMAT": "chatml", "RAY_OVERRIDE_JOB_RUNTIME_ENV": "1"}
for kv in extra.split():
    k, sep, v = kv.partition("=")
    if not sep:
        sys.exit(f"JOB_ENV: '{kv}' is not KEY=VALUE")
    env[k] = v
out = {"working_dir": root, "env_vars": env}
if excludes:
    out["excludes"] = excludes
print(json.dumps(out))
PY
)"
    echo "submit: $CONFIG, model $MODEL, run $RUN_NAME -> $SAVE_DIR"
    local wait_flag=()
    [[ "${NO_WAIT:-}" == 1 ]] && wait_flag=(--no-wait)
    ray job submit --address="$RAY_ADDRESS" \
        --runtime-env-json="$runtime_env" \
        "${wait_flag[@]}" \
        -- python3 -m war_openrlhf.cli.train_ppo \
        --config "$CONFIG" \
        --actor.model_name_or_path "$MODEL" \
        --data.prompt_dataset "$DATA_DIR/sql_train.jsonl" \
        --eval.dataset "$DATA_DIR/sql_eval.jsonl" \
        --ckpt.path "$SAVE_DIR/ckpt" \
        --ckpt.output_dir "$SAVE_DIR/model" \
        --logger.tensorboard_dir "$SAVE_DIR/tensorboard" \
        --logger.wandb.run_name "$RUN_NAME" \
        "$@"
    echo "TensorBoard: tensorboard --logdir $SAVE_DIR/tensorboard"
    echo "summary plot: python tools/plot_run.py --logdir $SAVE_DIR/tensorboard/$RUN_NAME --out $SAVE_DIR/$RUN_NAME.png"
}

cmd=all
case "${1:-}" in
    all|data|submit) cmd="$1"; shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit 0 ;;
esac
case "$cmd" in
    data) prepare_data ;;
    submit) submit "$@" ;;
    all) prepare_data; submit "$@" ;;
esac
