"""A run's PNG plots and summary table, from a metrics.jsonl written by a real run (the CPU quickstart, 4 steps,
validation every 2: `megarl train yaml_configs/cpu_quickstart.yaml trainer.total_steps=4 trainer.val_every=2`)."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from megarl.cli import main
from megarl.trainer.plots import plot_run, read_metrics, summary_table

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "quickstart_4_steps_metrics.jsonl")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def run_dir(tmp_path):
    shutil.copy(FIXTURE, tmp_path / "metrics.jsonl")
    return tmp_path


def test_every_panel_is_a_non_empty_png(run_dir):
    from matplotlib.image import imread  # the PNG decoder, not our writer

    paths = plot_run(str(run_dir))
    assert [os.path.basename(p) for p in paths] == ["reward.png", "validation.png", "kl.png", "entropy.png",
                                                    "response_length.png", "clip_fraction.png", "time_split.png"]
    for path in paths:
        assert os.path.dirname(path) == str(run_dir / "plots")
        with open(path, "rb") as f:
            assert f.read(8) == PNG_SIGNATURE, path
        pixels = imread(path)
        assert pixels.shape[:2] == (350, 600), path  # figsize 6 x 3.5 in at 100 dpi
        assert pixels[..., :3].std() > 0.05, f"{path} is blank"


def test_panels_without_data_are_skipped(tmp_path):
    rows = [json.loads(line) for line in open(FIXTURE)]
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps({k: v for k, v in r.items() if not k.startswith(("val/", "actor/entropy"))}) + "\n")
    names = [os.path.basename(p) for p in plot_run(str(tmp_path))]
    assert "validation.png" not in names and "entropy.png" not in names and "reward.png" in names


def test_summary_table_and_the_plot_command(run_dir, capsys):
    rows = [json.loads(line) for line in open(FIXTURE)]
    assert read_metrics(str(run_dir)) == rows
    table = summary_table(rows, 4)
    reward = [r["reward/mean"] for r in rows]
    line = next(x for x in table.splitlines() if x.strip().startswith("reward/mean"))
    assert [float(v) for v in line.split()[1:]] == pytest.approx(
        [reward[0], reward[-1], min(reward), max(reward)], rel=1e-3)
    assert table.startswith("run summary: steps 1..4 of 4")
    total = sum(r["time/step_s"] for r in rows)
    assert f"time {total:.1f} s: rollout" in table
    assert len(table.splitlines()) <= 24  # one screen
    assert main(["plot", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "run summary" in out and str(run_dir / "plots" / "reward.png") in out
    assert main(["plot", str(run_dir / "nothing")]) == 2


def test_missing_matplotlib_names_the_extra(run_dir, monkeypatch, capsys):
    import sys

    from megarl.trainer.plots import PlotsUnavailable

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    with pytest.raises(PlotsUnavailable, match=r"pip install 'megarl\[plots\]'"):
        plot_run(str(run_dir))
    assert main(["plot", str(run_dir)]) == 2
    assert "megarl: error: plots need matplotlib: pip install 'megarl[plots]'" in capsys.readouterr().err


def test_an_agent_runs_per_episode_numbers_get_their_panel(run_dir):
    """An `agent:` environment's rows (the keys megarl/serving/agents.py logs, with the info keys of
    examples/agents/react_calculator.py): the agent panel draws the per-episode means, not the failure counts or
    the reward (drawn in the reward panel); a run without agent keys has no agent panel."""
    from megarl.trainer.plots import PANELS, panel_keys

    rows = [json.loads(line) for line in open(FIXTURE)]
    assert "agent.png" not in [os.path.basename(p) for p in plot_run(str(run_dir))]
    agent = {"agent/errors": 2.0, "agent/timeouts": 1.0, "agent/reward_mean": 0.5, "agent/tool_success": 0.75,
             "agent/tool_calls": 1.25, "agent/requests_per_episode": 2.0, "agent/segments_per_episode": 1.0}
    rows = [{**r, **agent} for r in rows]
    with open(run_dir / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    fixed = dict((stem, keys) for stem, _, _, keys in PANELS)
    assert panel_keys("agent", fixed["agent"], rows) == (
        "agent/requests_per_episode", "agent/segments_per_episode", "agent/tool_calls", "agent/tool_success")
    assert panel_keys("reward", fixed["reward"], rows) == ("reward/mean",)
    paths = plot_run(str(run_dir))
    assert os.path.basename(paths[-2]) == "agent.png"  # after the fixed panels, before the time split
    with open(paths[-2], "rb") as f:
        assert f.read(8) == PNG_SIGNATURE
