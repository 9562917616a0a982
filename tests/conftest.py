"""Environment every test module gets before it imports vLLM, Ray or transformers (pytest loads
this file first): caches inside the checkout, no model hub, no Ray usage reporting, and the
checkout on PYTHONPATH so that engine and Ray worker processes import war_openrlhf from any cwd.
Settings that only some engines want (core binding, KV space) stay in their test modules."""

import faulthandler
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("VLLM_CACHE_ROOT", str(ROOT / ".cache" / "vllm"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)


# ---- hangs fail the run instead of stalling it ----------------------------------------------
# pytest-timeout (setup.cfg: a default per test; engine tests carry longer marks) fails a test
# that runs past its timeout by raising in the main thread (SIGALRM), so the rest of the suite
# still runs. A test stuck where no Python code runs never sees that signal: this backstop
# prints every thread's stack and ends the run BACKSTOP_GRACE_S later. --timeout=0 turns both
# off (a debugger session); --pdb turns the backstop off.
BACKSTOP_GRACE_S = 60
_stderr_fd = None


def pytest_configure(config):
    global _stderr_fd
    _stderr_fd = os.dup(2)  # output capture is off here: the terminal's (or CI log's) stderr


def pytest_timeout_set_timer(item, settings):
    if settings.timeout and _stderr_fd is not None and not item.config.getoption("usepdb"):
        faulthandler.dump_traceback_later(settings.timeout + BACKSTOP_GRACE_S, exit=True,
                                          file=_stderr_fd)
    # None: pytest-timeout's own timer is set too


def pytest_timeout_cancel_timer(item):
    faulthandler.cancel_dump_traceback_later()
