"""DAPO dynamic sampling through `megarl train` (yaml_configs/cpu_dapo.yaml: dynamic_sampling on, max_rounds 3),
run by a controller that joins a 2-node Ray cluster started with launch/'s scripts as a user runs them.

With reward.function=exact_match the random tiny model never produces the answer (every response runs to
max_new_tokens), so every group's scores are equal (0, plus the same soft overlong penalty): the step must generate
its 3 rounds of 8 prompts, drop 16 all-equal groups, fill the batch with the first 8 (so it still holds
prompts_per_step x samples_per_prompt = 32 samples) and count them.

The same run checks launch/ (no extra `megarl train` start-up in the suite; the cluster's start and stop add the
seconds `dapo_job` prints): `ray_start_head.sh` and `ray_start_worker.sh` make two Ray "nodes" on this machine
(separate temp dirs and ports, one logical CPU each, token auth with the token file in the cluster's temp dir), the
controller joins them as launch/slurm_ray.sbatch runs it (`RAY_ADDRESS=HEAD:PORT megarl train ...` on the head; a
Ray job through `ray_submit.sh` needs ray[default], which this stack does not install, so the script's refusal is
checked instead), `ray_stop.sh --temp-dir` stops each node, and no process of the cluster may be left.

Placement: the actor pool is 2 nodes x 1 slot (`resources.pools.default.nodes=2 devices_per_node=1`, Megatron TP 2
and vLLM TP 2 as in cpu_dapo.yaml); each node's slot is a 1-CPU placement group and each Ray node has 1 CPU, so rank
0 and rank 1 land on different nodes and the run's torch.distributed (gloo) world spans both. Which node each rank
ran on is read back from Ray: the pids the controller logs for its ranks, matched to the `_WorkerHost` actors' node
ids in the GCS's actor table.

Rollout on its own pool (not built yet): then give the actor pool and the rollout pool 1 node x 1 slot each; with
1 CPU per node they again land one per node, and `rank_nodes` below tells which pool's rank ran where (assert the
actor's node differs from the rollout's). Until then the rollout engines live in the actor's processes.
"""

from __future__ import annotations

import json
import os
import re
import time
import uuid

import pytest

from tests.e2e.ray_cluster import ScriptCluster, wait_gone

DAPO_ARGS = ("yaml_configs/cpu_dapo.yaml", "trainer.total_steps=1", "trainer.val_every=0",
             "reward.function=exact_match")
TWO_NODES = ("resources.pools.default.nodes=2", "resources.pools.default.devices_per_node=1")


@pytest.fixture(scope="module")
def dapo_job(tmp_path_factory):
    """Start the 2-node cluster, submit the one-step DAPO run, read Ray's record of where its ranks ran, stop the
    cluster; a dict of what the tests check (seconds of each phase under "seconds")."""
    run_dir = tmp_path_factory.mktemp("dapo")
    t = {"start": time.monotonic()}
    home_token = os.path.expanduser("~/.ray/auth_token")
    home_token_before = _stat(home_token)
    with ScriptCluster(cpus_per_node=1) as cluster:
        head_out = cluster.start_head().stdout
        token_made = os.path.isfile(cluster.env["RAY_AUTH_TOKEN_PATH"])
        cluster.add_worker()
        nodes = cluster.wait_for_nodes(2, timeout_s=60)
        t["cluster_up"] = time.monotonic()
        # ray_submit.sh needs ray[default] (the dashboard's job server), which requirements/cpu.txt does not
        # install: then the script must refuse with a message, and the controller runs on the head node the way
        # launch/slurm_ray.sbatch runs it (RAY_ADDRESS=GCS megarl train ...), joining the cluster.
        job_server = cluster.job_server()
        job_id = f"megarl-dapo-{uuid.uuid4().hex[:8]}"
        refused = None if job_server else cluster.submit(*DAPO_ARGS, submission_id=job_id, timeout_s=60)
        proc = cluster.run_controller(*DAPO_ARGS, *TWO_NODES, f"logging.dir={run_dir}")
        t["job_done"] = time.monotonic()
        actors = cluster.actors("_WorkerHost") if proc.returncode == 0 else []
        stop_output = cluster.stop()
        t["stopped"] = time.monotonic()
        left_after_stop = cluster.processes()
        left_after_stop = [f"{p.pid} {p.name()}" for p in left_after_stop]
        node_dirs, base = list(cluster.node_dirs), cluster.base
    seconds = {"cluster start": t["cluster_up"] - t["start"], "job": t["job_done"] - t["cluster_up"],
               "stop": t["stopped"] - t["job_done"]}
    print(f"dapo_job seconds: {seconds}")
    return dict(proc=proc, run_dir=run_dir, nodes=nodes, actors=actors, refused=refused, stop_output=stop_output,
                left_after_stop=left_after_stop, node_dirs=node_dirs, base=base, seconds=seconds, head_out=head_out,
                token_made=token_made, home_token_untouched=_stat(home_token) == home_token_before)


def _stat(path: str):
    """(mtime_ns, size) of `path`, None when absent."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_mtime_ns, st.st_size


def rank_nodes(log: str, actors: list[dict]) -> dict[int, str]:
    """{rank: Ray node id} of one worker group: the controller's "worker processes: rank 0 pid P, ..." line matched
    to the actors' pids (a pid is unique on this one machine while both nodes run)."""
    line = re.search(r"worker processes: (.*)", log)
    assert line, "the controller's log has no 'worker processes:' line"
    pids = {int(r): int(p) for r, p in re.findall(r"rank (\d+) pid (\d+)", line.group(1))}
    node_of_pid = {a["pid"]: a["node_id"] for a in actors}
    missing = {r: p for r, p in pids.items() if p not in node_of_pid}
    assert not missing, f"ranks {missing} (rank: pid) are not among the cluster's _WorkerHost actors {actors}"
    return {r: node_of_pid[p] for r, p in pids.items()}


def test_all_equal_groups_are_refilled_up_to_max_rounds_then_counted(dapo_job):
    proc, run_dir = dapo_job["proc"], dapo_job["run_dir"]
    assert proc.returncode == 0, proc.stdout[-6000:]
    row = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    got = {k: row[k] for k in row if k.startswith("dynamic_sampling/")}
    assert got == {"dynamic_sampling/rounds": 3.0, "dynamic_sampling/dropped_groups": 16.0,
                   "dynamic_sampling/filled_groups": 8.0, "dynamic_sampling/surplus_groups": 0.0}
    assert row["samples"] == 32.0 and row["reward/max"] == row["reward/min"]
    assert "8 of 8 groups have all-equal scores after algorithm.dynamic_sampling.max_rounds=3" in proc.stdout


def test_the_job_ran_on_both_nodes_one_rank_each(dapo_job):
    """Two nodes joined (the head and the worker); the controller's two ranks ran one on each, as Ray recorded."""
    assert dapo_job["proc"].returncode == 0, dapo_job["proc"].stdout[-6000:]
    nodes = dapo_job["nodes"]
    assert len(nodes) == 2 and sorted(n["is_head"] for n in nodes) == [False, True], nodes
    ranks = rank_nodes(dapo_job["proc"].stdout, dapo_job["actors"])
    assert sorted(ranks) == [0, 1], ranks
    assert {ranks[0], ranks[1]} == {n["node_id"] for n in nodes}, (ranks, nodes)


def test_ray_submit_refuses_clearly_without_the_job_server(dapo_job):
    """This stack installs plain `ray`, whose dashboard has no job server: ray_submit.sh says so and names both ways
    out (ray[default] on the head, or the controller on the head) instead of Ray's "Failed to connect to Ray"."""
    refused = dapo_job["refused"]
    # requirements/cpu.txt installs plain `ray`: a stack with ray[default] must make this test submit a real job
    assert refused is not None, "this Ray has a job server (ray[default]): test ray_submit.sh's submission instead"
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "has no job server" in refused.stderr and "ray[default]" in refused.stderr
    assert "RAY_ADDRESS=HEAD_IP:PORT megarl train yaml_configs/cpu_dapo.yaml" in refused.stderr


def test_the_head_made_its_token_where_told_and_left_home_alone(dapo_job):
    """Token authentication as ray_start_head.sh sets it up, with the token file named by RAY_AUTH_TOKEN_PATH
    (created by the script) and ~/.ray/auth_token neither created nor changed."""
    assert dapo_job["token_made"] and dapo_job["home_token_untouched"]
    assert "workers join with: bash launch/ray_start_worker.sh --address 127.0.0.1:" in dapo_job["head_out"]


def test_the_cluster_stops_with_the_script_and_leaves_nothing(dapo_job):
    """`ray_stop.sh --temp-dir` on each node (worker, then head) stopped every process of the cluster within its
    grace period (psutil finds none carrying its marker) and the cluster's temp dir is gone."""
    assert dapo_job["left_after_stop"] == [], f"still running after ray_stop.sh: {dapo_job['left_after_stop']}"
    assert dapo_job["stop_output"].count("[ray_stop] stopped") == 2, dapo_job["stop_output"]
    assert "SIGKILL" not in dapo_job["stop_output"], dapo_job["stop_output"]  # every process ended on SIGTERM
    assert wait_gone([dapo_job["base"]]) == []
    assert not os.path.exists(dapo_job["base"])
