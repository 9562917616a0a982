"""A training run's TensorBoard logs as a PNG summary and a one-screen text summary.

Used by ``tools/plot_run.py`` and by the CPU demo (:mod:`war_openrlhf.cli.cpu_demo`).

Reads every event file under ``--logdir`` (OpenRLHF's ``train/...`` scalars and the WAR
rollout scalars ``war/...``), plots rewards, rollout throughput, speculation, prefix-cache
hits, per-engine load and the step-time split, and prints the summary table.
"""

from __future__ import annotations

from pathlib import Path

PANELS = [
    ("reward", ["train/reward", "train/score", "war/reward_mean"]),
    ("rollout tokens/s", ["war/rollout_tokens_per_s"]),
    ("speculation", ["war/speculating_fraction", "war/spec_acceptance_rate", "war/tokens_per_verification_step"]),
    ("prefix-cache hit rate", ["war/prefix_hit_rate_engine", "war/prefix_hit_rate_dispatcher_first_turn"]),
    ("turns per engine", None),  # war/engine*_turns
    ("step time split (s)", ["train/timing/generation", "train/timing/make_experience", "train/timing/ppo_train",
                             "train/timing/broadcast"]),
    ("episode length", ["war/episode_turns_mean", "war/episode_tokens_mean"]),
]


def load_scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[str, list[tuple[int, float]]] = {}
    files = sorted(logdir.rglob("events.out.tfevents.*"))
    if not files:
        raise ValueError(f"logdir: no TensorBoard event files under {logdir}")
    for f in files:
        acc = EventAccumulator(str(f), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags().get("scalars", []):
            series = out.setdefault(tag, [])
            series.extend((e.step, e.value) for e in acc.Scalars(tag))
    for tag in out:
        out[tag].sort()
    return out


def _get(scalars, *names):
    for n in names:
        if n in scalars and scalars[n]:
            return scalars[n]
    return []


def summary_lines(scalars) -> list[str]:
    def last(*names):
        s = _get(scalars, *names)
        return s[-1][1] if s else None

    def mean(*names):
        s = _get(scalars, *names)
        return sum(v for _, v in s) / len(s) if s else None

    def fmt(v, spec=".3f"):
        return "n/a" if v is None else format(v, spec)

    steps = max((len(v) for k, v in scalars.items() if k.startswith("train/")), default=0)
    rewards = [v for _, v in _get(scalars, "train/reward", "war/reward_mean")]
    return [
        f"steps:                      {steps}",
        f"reward first -> last:       {fmt(rewards[0] if rewards else None)} -> {fmt(rewards[-1] if rewards else None)}",
        f"rollout tokens/s (mean):    {fmt(mean('war/rollout_tokens_per_s'), ',.0f')}",
        f"speculating fraction:       {fmt(mean('war/speculating_fraction'))}",
        f"draft acceptance rate:      {fmt(mean('war/spec_acceptance_rate'))}",
        f"tokens / verification step: {fmt(mean('war/tokens_per_verification_step'), '.2f')}",
        f"prefix hit rate (engines):  {fmt(mean('war/prefix_hit_rate_engine'))}",
        f"episode turns (mean):       {fmt(mean('war/episode_turns_mean'), '.2f')}",
        f"generation s / step:        {fmt(mean('train/timing/generation'), '.1f')}",
        f"train s / step:             {fmt(mean('train/timing/ppo_train'), '.1f')}",
        f"weight sync s / step:       {fmt(mean('train/timing/broadcast'), '.2f')}",
    ]


def plot(scalars, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 4, figsize=(16, 7))
    for ax, (title, tags) in zip(axes.flat, PANELS):
        if tags is None:
            tags = sorted(t for t in scalars if t.startswith("war/engine") and t.endswith("_turns"))
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
    ax = axes.flat[-1]
    ax.axis("off")
    ax.text(0.0, 1.0, "\n".join(summary_lines(scalars)), va="top", family="monospace", fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)


