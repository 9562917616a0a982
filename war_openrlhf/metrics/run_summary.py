"""A training run's TensorBoard logs as a PNG summary and a one-screen text summary.

Used by ``tools/plot_run.py`` and by the CPU demo (:mod:`war_openrlhf.cli.cpu_demo`).

Reads every event file under ``--logdir`` (OpenRLHF's ``train/...`` scalars and the WAR
rollout scalars, logged as ``train/war/...`` and read here as ``war/...``), plots rewards, rollout throughput, speculation, prefix-cache
hits, per-engine load and the step-time split, and prints the summary table.
"""

from __future__ import annotations

from pathlib import Path

PANELS = [
    ("reward", ["train/reward", "train/score", "war/reward_mean"]),
    ("rollout tokens/s", ["war/rollout_tokens_per_s"]),
    ("speculation", ["war/speculating_fraction", "war/spec_acceptance_rate", "war/tokens_per_verification_step"]),
    ("draft acceptance per engine", "war/engine*_spec_acceptance_rate"),
    ("prefix-cache hit rate", ["war/prefix_hit_rate_engine", "war/prefix_hit_rate_dispatcher_first_turn"]),
    ("turns per engine", "war/engine*_turns"),
    ("step time split (s)", ["train/timing/generation", "train/timing/make_experience", "train/timing/ppo_train",
                             "train/timing/broadcast"]),
    ("episode length", ["war/episode_turns_mean", "war/episode_tokens_mean"]),
]


def load_scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    from .tb_scalars import read_scalars

    if not any(Path(logdir).rglob("events.out.tfevents.*")):
        raise ValueError(f"logdir: no TensorBoard event files under {logdir}")
    out: dict[str, list[tuple[int, float]]] = {}
    for tag, points in read_scalars(logdir).items():
        # WAR's scalars are logged by OpenRLHF's trainer as train/war/...: read as war/...
        out.setdefault(tag[len("train/"):] if tag.startswith("train/war/") else tag, []).extend(points)
    for tag in out:
        out[tag].sort()
    return out


def _get(scalars, *names):
    for n in names:
        if n in scalars and scalars[n]:
            return scalars[n]
    return []


def summary_values(scalars) -> dict:
    """The run's headline figures (means over steps where a figure is logged per step; None
    where the run logged nothing of it): what the text summary prints and a run record keeps."""
    def mean(*names):
        s = _get(scalars, *names)
        return sum(v for _, v in s) / len(s) if s else None

    rewards = [v for _, v in _get(scalars, "train/reward", "war/reward_mean")]
    first2, last2 = reward_ends(scalars)
    engines = len(_matching(scalars, "war/engine*_spec_acceptance_rate"))
    return {
        "steps": max((len(v) for k, v in scalars.items() if k.startswith("train/")), default=0),
        "reward_first": rewards[0] if rewards else None,
        "reward_last": rewards[-1] if rewards else None,
        "reward_first2": first2,
        "reward_last2": last2,
        "rollout_tokens_per_s": mean("war/rollout_tokens_per_s"),
        "speculating_fraction": mean("war/speculating_fraction"),
        "acceptance": mean("war/spec_acceptance_rate"),
        "tokens_per_verification_step": mean("war/tokens_per_verification_step"),
        "engines": [{"acceptance": mean(f"war/engine{i}_spec_acceptance_rate"),
                     "tokens_per_verification_step": mean(f"war/engine{i}_tokens_per_verification_step")}
                    for i in range(engines)],
        "prefix_hit_rate": mean("war/prefix_hit_rate_engine"),
        "episode_turns_mean": mean("war/episode_turns_mean"),
        "generation_s_per_step": mean("train/timing/generation"),
        "train_s_per_step": mean("train/timing/ppo_train"),
        "weight_sync_s_per_step": mean("train/timing/broadcast"),
    }


def summary_lines(scalars) -> list[str]:
    v = summary_values(scalars)

    def fmt(x, spec=".3f"):
        return "n/a" if x is None else format(x, spec)

    per_engine = [f"  engine {i}: acceptance {fmt(e['acceptance'])}, "
                  f"tokens / verification step {fmt(e['tokens_per_verification_step'], '.2f')}"
                  for i, e in enumerate(v["engines"])]
    return [
        f"steps:                      {v['steps']}",
        f"reward first -> last:       {fmt(v['reward_first'])} -> {fmt(v['reward_last'])}",
        f"reward first 2 -> last 2:   {fmt(v['reward_first2'])} -> {fmt(v['reward_last2'])}",
        f"rollout tokens/s (mean):    {fmt(v['rollout_tokens_per_s'], ',.0f')}",
        f"speculating fraction:       {fmt(v['speculating_fraction'])}",
        f"draft acceptance rate:      {fmt(v['acceptance'])}",
        f"tokens / verification step: {fmt(v['tokens_per_verification_step'], '.2f')}",
        *per_engine,
        f"prefix hit rate (engines):  {fmt(v['prefix_hit_rate'])}",
        f"episode turns (mean):       {fmt(v['episode_turns_mean'], '.2f')}",
        f"generation s / step:        {fmt(v['generation_s_per_step'], '.1f')}",
        f"train s / step:             {fmt(v['train_s_per_step'], '.1f')}",
        f"weight sync s / step:       {fmt(v['weight_sync_s_per_step'], '.2f')}",
    ]


def _matching(scalars, pattern: str) -> list[str]:
    """Tags ``prefix*suffix`` in engine order (engine2 before engine10)."""
    prefix, suffix = pattern.split("*")
    found = [t for t in scalars if t.startswith(prefix) and t.endswith(suffix)
             and t[len(prefix):len(t) - len(suffix)].isdigit()]
    return sorted(found, key=lambda t: int(t[len(prefix):len(t) - len(suffix)]))


def reward_ends(scalars) -> tuple[float | None, float | None]:
    """Mean reward of the first two and of the last two steps (the demo's learning check)."""
    rewards = [v for _, v in _get(scalars, "train/reward", "war/reward_mean")]
    if len(rewards) < 2:
        return None, None
    return sum(rewards[:2]) / 2, sum(rewards[-2:]) / 2


def _comparison_panel(ax, comparison: dict) -> None:
    """Bars of the median rollout step per configuration, min-max whiskers when the
    ``bench_rollout`` JSON summary has the spread."""
    names = list(comparison["configs"])
    steps = [comparison["configs"][n]["step_s"] for n in names]
    spreads = [comparison["configs"][n].get("step_s_spread") for n in names]
    yerr = ([[s - lo for s, (lo, _) in zip(steps, spreads)], [hi - s for s, (_, hi) in zip(steps, spreads)]]
            if all(spreads) else None)
    bars = ax.bar(names, steps, yerr=yerr, capsize=4,
                  color=["#999999" if n == "openrlhf" else "#1f77b4" for n in names])
    for b, n in zip(bars, names):
        x = comparison["configs"][n].get("x_openrlhf")
        ax.annotate(f"{b.get_height():.2f} s" + (f"\n{x:.2f}x" if x else ""), (b.get_x() + b.get_width() / 2,
                    b.get_height()), ha="center", va="bottom", fontsize=8)
    ax.set_title("rollout step, same prompts (s, median, min-max)")
    ax.set_ylabel("seconds")
    ax.margins(y=0.25)
    ax.text(0.5, -0.2, comparison.get("regime", ""), ha="center", va="top", transform=ax.transAxes, fontsize=7)


def plot(scalars, out: Path, comparison: dict | None = None) -> None:
    """The panels of :data:`PANELS`, ``comparison`` (a side-by-side rollout step) when given,
    and the text summary."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 5, figsize=(22, 8.5))
    for ax, (title, tags) in zip(axes.flat, PANELS):
        if isinstance(tags, str):
            tags = _matching(scalars, tags)
        drawn = False
        for t in tags:
            s = scalars.get(t)
            if s:
                ax.plot([x for x, _ in s], [y for _, y in s], marker="o", label=t.split("/", 1)[-1])
                drawn = True
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if drawn:
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    ax = axes.flat[len(PANELS)]
    if comparison:
        _comparison_panel(ax, comparison)
    else:
        ax.axis("off")
    ax = axes.flat[-1]
    ax.axis("off")
    ax.text(0.0, 1.0, "\n".join(summary_lines(scalars)), va="top", family="monospace", fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)


