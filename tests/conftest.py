"""Environment every test module gets before it imports vLLM, Ray or transformers (pytest loads
this file first): caches inside the checkout, no model hub, no Ray usage reporting, and the
checkout on PYTHONPATH so that engine and Ray worker processes import war_openrlhf from any cwd.
Settings that only some engines want (core binding, KV space) stay in their test modules."""

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("VLLM_CACHE_ROOT", str(ROOT / ".cache" / "vllm"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
