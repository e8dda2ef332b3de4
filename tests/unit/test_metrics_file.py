"""A fresh run's metrics.jsonl: an earlier run's file in the same logging.dir is moved aside, never appended to."""

import json

from megarl.trainer.rl_trainer import set_aside_earlier_metrics


def _write(path, steps):
    path.write_text("".join(json.dumps({"step": s, "reward/mean": 0.1 * s}) + "\n" for s in steps))


def test_an_earlier_runs_metrics_are_moved_to_the_first_free_name(tmp_path):
    path = tmp_path / "metrics.jsonl"
    assert set_aside_earlier_metrics(str(path)) is None  # nothing there
    path.write_text("")
    assert set_aside_earlier_metrics(str(path)) is None and path.exists()  # empty: left in place
    _write(path, [1, 2, 3])
    first = path.read_text()
    assert set_aside_earlier_metrics(str(path)) == str(tmp_path / "metrics.1.jsonl")
    assert not path.exists() and (tmp_path / "metrics.1.jsonl").read_text() == first
    _write(path, [1])
    assert set_aside_earlier_metrics(str(path)) == str(tmp_path / "metrics.2.jsonl")
    assert (tmp_path / "metrics.1.jsonl").read_text() == first  # the older one untouched
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.2.jsonl").read_text().splitlines()] == [1]
