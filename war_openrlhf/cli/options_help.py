"""``war-train --help``: every WAR option with its default and what it means.

The text comes from the shipped default configs (``configs/rollout.yaml``, ``engine.yaml``,
``suffix_index.yaml``: the documented defaults, one comment per key) and the option set of
:class:`~war_openrlhf.rollout.RolloutConfig` (so a key without a comment still appears,
with its default), plus each dispatch policy's options (``dispatch_kwargs``: the fields of the
policy's typed options, :class:`~war_openrlhf.dispatch.PolicyOptions`, with their defaults and
meanings).
"""

from __future__ import annotations

import re
from dataclasses import asdict, fields
from typing import Any

from ..config_checks import config_path

__all__ = ["war_help", "war_option_defaults"]

USAGE = """usage: war-train [--config FILE] [--war.config FILE] [--war.KEY VALUE ...] [--ray-address HOST:PORT]
                 <train_ppo_ray arguments, unchanged>
       war-train --preflight [--skip-engine] [--json FILE]

OpenRLHF's train_ppo_ray with WAR rollouts (docs: README.md, docs/gpu.md).
  --config FILE         a YAML with an `openrlhf:` section (train_ppo_ray arguments, a key per
                        argument, true for a flag) and a `war:` section (the keys below)
  --war.config FILE     WAR keys from a YAML (its top-level keys, or its `war:` section)
  --war.KEY VALUE       one WAR key (dotted: --war.engine.speculation off)
  --ray-address ADDR    join a running Ray cluster (default: RAY_ADDRESS, else start Ray here)
  --preflight           check this node (CUDA, flash-attn, fused Adam, vLLM, engine, NCCL)

Precedence, one rule: defaults < --config / --war.config files (later files win) < --war.KEY
options, key by key (nested sections merge). Keys that OpenRLHF's arguments define (model,
lengths, seed, engine count, agent file, samples per prompt, temperature, top-p, tensor
parallel size, GPU memory, sleep mode) are refused here: set them with OpenRLHF's flags.
Everything is checked before Ray starts."""

_KEY_LINE = re.compile(r"^(\s*)([A-Za-z_][A-Za-z0-9_]*):\s*(.*?)\s*(?:#\s?(.*))?$")


def _comments(name: str, prefix: str) -> dict[str, str]:
    """``dotted key -> comment`` from a shipped config (nested sections by indentation)."""
    out: dict[str, str] = {}
    stack: list[tuple[int, str]] = []
    pending: list[str] = []
    last: str | None = None  # the key whose inline comment an indented comment line continues
    for raw in config_path(name).read_text().splitlines():
        if raw.strip().startswith("#"):
            text = raw.strip().lstrip("#").strip()
            if last is not None and raw[:1].isspace() and not pending:
                out[last] += " " + text
            else:
                pending.append(text)
            continue
        last = None
        m = _KEY_LINE.match(raw)
        if not m:
            pending = []
            continue
        indent, key, value, comment = len(m.group(1)), m.group(2), m.group(3), m.group(4)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        dotted = prefix + ".".join([k for _, k in stack] + [key])
        text = comment or (" ".join(pending) if pending else "")
        if text:
            out[dotted] = text
        if comment:
            last = dotted
        pending = []
        if value == "":
            stack.append((indent, key))
    return out


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in d.items():
        if isinstance(value, dict) and key not in ("dispatch_kwargs",):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def war_option_defaults() -> dict[str, Any]:
    """Every WAR key (dotted) and its default."""
    from ..rollout import RolloutConfig

    return _flatten(asdict(RolloutConfig()))


def dispatch_options_help() -> list[str]:
    """``dispatch_kwargs`` of each dispatch policy: its options' defaults, then their meanings."""
    from ..dispatch import POLICIES

    lines: list[str] = []
    for name, policy in POLICIES.items():
        opts = fields(policy.Options)
        defaults = ", ".join(f"{f.name}={f.default!r}" for f in opts)
        lines.append(f"dispatch_kwargs of dispatch_policy {name}: {defaults or '(none)'}")
        lines += [f"  {f.name}: {f.metadata['help']}" for f in opts if f.metadata.get("help")]
    return lines


def war_help() -> str:
    from ..integrations.openrlhf import OPENRLHF_OWNED, WAR_TRAIN_DEFAULTS

    notes = {**_comments("suffix_index", "engine.index."), **_comments("engine", "engine."),
             **_comments("rollout", "")}
    lines = [USAGE, "", "WAR keys (--war.KEY VALUE; default, then meaning):"]
    for key, default in war_option_defaults().items():
        if key in OPENRLHF_OWNED:
            owner = OPENRLHF_OWNED[key]
            lines.append(f"  {key:<38} (set by OpenRLHF's --{owner})")
            continue
        default = WAR_TRAIN_DEFAULTS.get(key, default)  # what a war-train run gets
        lines.append(f"  {key:<38} {default!r:<12} {notes.get(key, '')}".rstrip())
    lines += ["", "Dispatch policy options (--war.dispatch_kwargs.KEY VALUE; checked against dispatch_policy):"]
    lines += dispatch_options_help()
    return "\n".join(lines)
