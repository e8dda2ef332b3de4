"""A run's pictures and summary, from `RUN_DIR/metrics.jsonl` alone (so `megarl plot RUN_DIR` works on any finished
or running run, on any machine).

`plot_run(run_dir)` writes PNGs (matplotlib, headless Agg backend; extra `plots`) into `RUN_DIR/plots/`, one per
panel that has data: reward (mean with the min..max band), validation (every `val/*` metric but error counts), KL
(against the reference `actor/kl`, and the approximate KL to the old policy), entropy, response length (tokens), clip
fraction, tool use (multi-turn episodes), agent episodes (an `agent:` environment's per-episode means: each number of
the agent's info dict, e.g. `agent/tool_success`, and `agent/requests_per_episode` / `agent/segments_per_episode`), and
the time split per phase (stacked seconds of each `time/<phase>_s` per step). Returns the paths.

`summary_table(rows)` is the one-screen text table printed at the end of a run: first / last / min / max of the
headline metrics and each phase's share of the step time.
"""

from __future__ import annotations

import json
import math
import os
import textwrap
from typing import Optional

# (file stem, title, y label, metric keys drawn as lines)
PANELS = (
    ("reward", "Reward", "reward (mean over samples)", ("reward/mean",)),
    ("validation", "Validation", "validation metric", ()),  # every val/* key, found in the rows
    ("kl", "KL", "KL (nats / token)", ("actor/kl", "actor/approx_kl")),
    ("entropy", "Policy entropy", "entropy (nats / token)", ("actor/entropy",)),
    ("response_length", "Response length", "tokens", ("response_length/mean",)),
    ("clip_fraction", "Clip fraction", "fraction of tokens clipped", ("actor/clip_frac",)),
    ("tool_use", "Tool use (multi-turn)", "fraction of episodes",
     ("multi_turn/tool_success_frac", "multi_turn/tool_use_frac", "multi_turn/truncated_frac")),
    ("agent", "Agent episodes (OpenAI endpoint)", "mean per episode", ()),  # the agent/* per-episode keys
)
# agent/* keys that are not per-episode means (counts of the step's failed episodes; the reward, drawn in "reward")
AGENT_NOT_PER_EPISODE = ("agent/errors", "agent/timeouts", "agent/reward_mean")
SUMMARY_KEYS = ("reward/mean", "val/reward_mean", "actor/kl", "actor/approx_kl", "actor/entropy",
                "response_length/mean", "actor/clip_frac", "actor/grad_norm", "time/step_s")
PLOTS_MISSING = "plots need matplotlib: pip install 'megarl[plots]' (metrics.jsonl holds every metric of every step)"


class PlotsUnavailable(RuntimeError):
    """matplotlib is not installed (the message names the extra)."""


def read_metrics(run_dir: str) -> list[dict]:
    """The rows of `run_dir/metrics.jsonl` (one dict per logged step, in file order); [] when there is none. A
    resumed run appends to the file: a step logged twice keeps its last row."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    by_step: dict[int, dict] = {}
    with open(path) as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                by_step[int(row["step"])] = row
    return [by_step[s] for s in sorted(by_step)]


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], float(r[key])) for r in rows
           if isinstance(r.get(key), (int, float)) and math.isfinite(float(r[key]))]
    return [p[0] for p in pts], [p[1] for p in pts]


def phase_keys(rows: list[dict]) -> list[str]:
    """The per-phase time keys (`time/<phase>_s` except the whole step), in first-seen order."""
    keys: dict[str, None] = {}
    for r in rows:
        for k in r:
            if k.startswith("time/") and k.endswith("_s") and k != "time/step_s":
                keys[k] = None
    return list(keys)


def panel_keys(stem: str, keys: tuple[str, ...], rows: list[dict]) -> tuple[str, ...]:
    """The metric keys panel `stem` draws: its fixed `keys`, or for "validation" every `val/*` key of `rows` but
    error counts, for "agent" every `agent/*` key but `AGENT_NOT_PER_EPISODE` (what the agent's info dict reported,
    e.g. tool_success, with the requests and segments per episode), sorted."""
    if stem == "validation":
        return tuple(sorted({k for r in rows for k in r if k.startswith("val/") and "error" not in k}))
    if stem == "agent":
        return tuple(sorted({k for r in rows for k in r if k.startswith("agent/") and k not in AGENT_NOT_PER_EPISODE}))
    return keys


def plot_run(run_dir: str, out_dir: Optional[str] = None) -> list[str]:
    """Write the run's PNG plots into `out_dir` (default `run_dir/plots`); returns the paths written, in PANELS
    order then the time split. Raises PlotsUnavailable without matplotlib, FileNotFoundError without metrics."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotsUnavailable(PLOTS_MISSING) from None
    rows = read_metrics(run_dir)
    if not rows:
        raise FileNotFoundError(f"{run_dir}: no metrics.jsonl with any step (is it a megarl run directory?)")
    out_dir = out_dir or os.path.join(run_dir, "plots")
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for stem, title, ylabel, keys in PANELS:
        drawn = [(k, *_series(rows, k)) for k in panel_keys(stem, keys, rows)]
        drawn = [d for d in drawn if d[1]]
        if not drawn:
            continue
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for key, steps, values in drawn:
            ax.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3, label=key)
        if stem == "reward":
            steps, lo = _series(rows, "reward/min")
            _, hi = _series(rows, "reward/max")
            if steps and len(lo) == len(hi):
                ax.fill_between(steps, lo, hi, alpha=0.2, label="min..max")
        _finish(ax, title, ylabel)
        paths.append(_save(fig, plt, os.path.join(out_dir, f"{stem}.png")))
    phases = phase_keys(rows)
    if phases:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        bottom = [0.0] * len(rows)
        steps = [r["step"] for r in rows]
        for key in phases:
            values = [float(r.get(key, 0.0)) for r in rows]
            ax.bar(steps, values, bottom=bottom, label=key[len("time/"):-len("_s")])
            bottom = [b + v for b, v in zip(bottom, values)]
        _finish(ax, "Time per phase", "seconds")
        paths.append(_save(fig, plt, os.path.join(out_dir, "time_split.png")))
    return paths


def _finish(ax, title: str, ylabel: str) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")


def _save(fig, plt, path: str) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def summary_table(rows: list[dict], total_steps: Optional[int] = None) -> str:
    """Plain-text table (fits one screen): steps run, each headline metric's first / last / min / max, then each
    phase's total seconds and share of the summed step time."""
    steps = [r["step"] for r in rows]
    head = f"run summary: steps {steps[0]}..{steps[-1]}" + (f" of {total_steps}" if total_steps else "")
    lines = [head, f"  {'metric':<22}{'first':>10}{'last':>10}{'min':>10}{'max':>10}"]
    for key in SUMMARY_KEYS:
        _, v = _series(rows, key)
        if v:
            lines.append(f"  {key:<22}{v[0]:>10.4g}{v[-1]:>10.4g}{min(v):>10.4g}{max(v):>10.4g}")
    total = sum(_series(rows, "time/step_s")[1])
    if total > 0:
        shares = []
        for key in phase_keys(rows):
            t = sum(_series(rows, key)[1])
            shares.append(f"{key[len('time/'):-len('_s')]} {t:.1f} s ({100 * t / total:.0f}%)")
        lines += textwrap.wrap(f"time {total:.1f} s: " + ", ".join(shares), width=100, initial_indent="  ",
                               subsequent_indent="    ")
    return "\n".join(lines)
