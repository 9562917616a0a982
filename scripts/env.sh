# Environment shared by the project's scripts: caches inside the repo's ignored
# .cache/, vLLM's CPU settings for small test engines, quiet third-party logs.
_WAR_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export VLLM_CACHE_ROOT="${VLLM_CACHE_ROOT:-$_WAR_ROOT/.cache/vllm}"
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
export HF_HUB_OFFLINE=1
export TOKENIZERS_PARALLELISM=false
export RAY_USAGE_STATS_ENABLED=0
export PYTHONWARNINGS="${PYTHONWARNINGS:-ignore::FutureWarning}"
