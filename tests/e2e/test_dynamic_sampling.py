"""DAPO dynamic sampling through `megarl train` (yaml_configs/cpu_dapo.yaml: dynamic_sampling on, max_rounds 3),
with the vLLM engine on a rollout pool of its own (`rollout.pool`, `megarl.rollout.service.PoolRollout`), submitted
with launch/ray_submit.sh to a 2-node Ray cluster started with launch/'s scripts as a user runs them.

With reward.function=exact_match the random tiny model never produces the answer (every response runs to
max_new_tokens), so every group's scores are equal (0, plus the same soft overlong penalty): the step must generate
its 3 rounds of 8 prompts on the rollout pool, drop 16 all-equal groups, fill the batch with the first 8 (so it
still holds prompts_per_step x samples_per_prompt = 32 samples) and count them.

The same run checks launch/ (no extra `megarl train` start-up in the suite; the cluster's start and stop add the
seconds `dapo_job` prints): `ray_start_head.sh` and `ray_start_worker.sh` make two Ray "nodes" on this machine
(separate temp dirs and ports, one logical CPU each, token auth with the token file in the cluster's temp dir);
`ray_submit.sh --driver --address HEAD:PORT CONFIG ...` runs the controller on this machine attached to the cluster
(a Ray job -- `ray_submit.sh` without --driver -- needs ray[default], which this stack does not install: that
refusal is checked too); `ray_stop.sh --temp-dir` stops each node, and no process of the cluster may be left.

Placement: the actor's pool `default` is 1 node x 1 slot (Megatron TP1) and the rollout pool `rollout` 1 node x 1
slot (one vLLM TP1 engine); each slot is a 1-CPU placement group and each Ray node has 1 CPU, so the two pools land
on different nodes and the weight sync (`megarl.controller.bridge`, gloo over TCP) crosses them. Which node each
pool ran on is read back from Ray, not from the config: the pids the controller logs for each pool's ranks
("worker processes: actor pool ...; rollout pool ..."), matched to the `_WorkerHost` actors' node ids in the GCS's
actor table. The sync of the step is checked verified (each rollout rank checked every piece routed into it against
its sender's checksum) and equal to its lower bound.

Time (2-core Intel Xeon shared with other jobs, 2026-12-03, `flock /tmp/megarl-heavy.lock python -m pytest -q
tests/e2e/test_dynamic_sampling.py --durations=0`; the machine's load moves it by several seconds): before this layout
(actor TP2 over both nodes, engines colocated, the controller started without ray_submit.sh) 33.7, 28.7, 24.4 and
24.6 s; with it 27.9, 31.0, 34.5 and 26.9 s, then, with logging.plots=false, 26.4 and 25.3 s (the last two of each
back to back: ~+1.5 s, the second worker group and the bridge; the cluster's start and stop are unchanged).
"""

from __future__ import annotations

import json
import os
import re
import time

import pytest

from tests.ray_cluster import ScriptCluster, wait_gone

DAPO_ARGS = ("yaml_configs/cpu_dapo.yaml", "trainer.total_steps=1", "trainer.val_every=0",
             "reward.function=exact_match", "logging.plots=false")  # plots: the shared quickstart run checks them
# the actor (TP1) alone on pool `default`, one vLLM TP1 engine on pool `rollout`: one slot each
TWO_POOLS = ("resources.pools.default.devices_per_node=1", "actor.parallel.tp=1",
             "resources.pools.rollout.nodes=1", "resources.pools.rollout.devices_per_node=1",
             "rollout.pool=rollout", "rollout.tp=1")


@pytest.fixture(scope="module")
def dapo_job(tmp_path_factory):
    """Start the 2-node cluster, submit the one-step DAPO run with ray_submit.sh --driver, read Ray's record of where
    its ranks ran, stop the cluster; a dict of what the tests check (seconds of each phase under "seconds")."""
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
        # ray_submit.sh's job mode needs ray[default] (the dashboard's job server), which requirements/cpu.txt does
        # not install: then it must refuse with a message; --driver runs the controller here, attached to the cluster
        job_server = cluster.job_server()
        refused = None if job_server else cluster.submit(*DAPO_ARGS, submission_id="megarl-dapo", timeout_s=60)
        proc = cluster.submit(*DAPO_ARGS, *TWO_POOLS, f"logging.dir={run_dir}", driver=True)
        t["job_done"] = time.monotonic()
        actors = cluster.actors("_WorkerHost") if proc.returncode == 0 else []
        stop_output = cluster.stop()
        t["stopped"] = time.monotonic()
        left_after_stop = [f"{p.pid} {p.name()}" for p in cluster.processes()]
        base = cluster.base
    seconds = {"cluster start": t["cluster_up"] - t["start"], "job": t["job_done"] - t["cluster_up"],
               "stop": t["stopped"] - t["job_done"]}
    print(f"dapo_job seconds: {seconds}")
    return dict(proc=proc, run_dir=run_dir, nodes=nodes, actors=actors, refused=refused, stop_output=stop_output,
                left_after_stop=left_after_stop, base=base, seconds=seconds, head_out=head_out,
                token_made=token_made, home_token_untouched=_stat(home_token) == home_token_before)


def _stat(path: str):
    """(mtime_ns, size) of `path`, None when absent."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_mtime_ns, st.st_size


def _rows(dapo_job) -> list[dict]:
    proc = dapo_job["proc"]
    assert proc.returncode == 0, proc.stdout[-6000:]
    return [json.loads(line) for line in (dapo_job["run_dir"] / "metrics.jsonl").read_text().splitlines()]


def pool_nodes(log: str, actors: list[dict]) -> dict[str, dict[int, str]]:
    """{"actor": {rank: Ray node id}, "rollout": {...}}: the controller's "worker processes: actor pool 'A': rank 0
    pid P, ...; rollout pool 'R': rank 0 pid Q, ..." line matched to the actors' pids (a pid is unique on this one
    machine while both nodes run)."""
    line = re.search(r"worker processes: (actor pool .*)", log)
    assert line, "the controller's log has no 'worker processes: actor pool ...' line"
    node_of_pid = {a["pid"]: a["node_id"] for a in actors}
    out = {}
    for side, ranks in re.findall(r"(actor|rollout) pool '[^']+': ((?:rank \d+ pid \d+(?:, )?)+)", line.group(1)):
        pids = {int(r): int(p) for r, p in re.findall(r"rank (\d+) pid (\d+)", ranks)}
        missing = {r: p for r, p in pids.items() if p not in node_of_pid}
        assert not missing, (f"{side} ranks {missing} (rank: pid) are not among the cluster's _WorkerHost actors: "
                             f"{actors}")
        out[side] = {r: node_of_pid[p] for r, p in pids.items()}
    return out


def test_all_equal_groups_are_refilled_up_to_max_rounds_then_counted(dapo_job):
    """Dynamic sampling with the engine on its own pool (PoolRollout): 3 rounds generated there."""
    row = _rows(dapo_job)[0]
    got = {k: row[k] for k in row if k.startswith("dynamic_sampling/")}
    assert got == {"dynamic_sampling/rounds": 3.0, "dynamic_sampling/dropped_groups": 16.0,
                   "dynamic_sampling/filled_groups": 8.0, "dynamic_sampling/surplus_groups": 0.0}
    assert row["samples"] == 32.0 and row["reward/max"] == row["reward/min"]
    warning = "8 of 8 groups have all-equal scores after algorithm.dynamic_sampling.max_rounds=3"
    assert warning in dapo_job["proc"].stdout


def test_the_actor_pool_and_the_rollout_pool_ran_on_different_nodes(dapo_job):
    """Two nodes joined (the head and the worker); the actor's one rank ran on one and the engine's on the other, as
    Ray's actor table records them."""
    _rows(dapo_job)
    nodes = dapo_job["nodes"]
    assert len(nodes) == 2 and sorted(n["is_head"] for n in nodes) == [False, True], nodes
    placed = pool_nodes(dapo_job["proc"].stdout, dapo_job["actors"])
    assert sorted(placed) == ["actor", "rollout"], placed
    assert sorted(placed["actor"]) == sorted(placed["rollout"]) == [0], placed
    assert placed["actor"][0] != placed["rollout"][0], placed
    assert {placed["actor"][0], placed["rollout"][0]} == {n["node_id"] for n in nodes}, (placed, nodes)


def test_the_sync_crossed_the_bridge_verified_at_its_lower_bound(dapo_job):
    """The weights went over the bridge (actor = bridge rank 0, engine = bridge rank 1); the step's sync was verified
    piece by piece and the engine received exactly its shard."""
    out = dapo_job["proc"].stdout
    # the store's host is what Ray tells actor rank 0 its IP is (`ray.util.get_node_ip_address()`: this machine's
    # routable address, although both nodes registered as 127.0.0.1)
    assert re.search(r"bridge 'actor-rollout' over [\w.:-]+:\d+: actor ranks -> bridge \[0\], rollout ranks -> "
                     r"bridge \[1\]", out), out[-6000:]
    for row in _rows(dapo_job):
        assert row["reshard/pool/verified"] == 1.0 and row["reshard/verified_pieces"] > 0, row
        assert row["reshard/pool/received_bytes_rank0"] == row["reshard/pool/lower_bound_bytes"] > 0, row
        assert row["reshard/pool/sent_bytes_rank0"] == row["reshard/pool/received_bytes_rank0"], row


def test_ray_submit_driver_mode_says_what_it_runs(dapo_job):
    """`ray_submit.sh --driver` names the mode, the cluster and the command before the controller's own output."""
    out = dapo_job["proc"].stdout
    assert ("[ray_submit] driver mode: the controller runs here" in out
            and "attached to the cluster at 127.0.0.1:" in out and "megarl train yaml_configs/cpu_dapo.yaml" in out), \
        out[:3000]


def test_ray_submit_refuses_clearly_without_the_job_server(dapo_job):
    """This stack installs plain `ray`, whose dashboard has no job server: ray_submit.sh's job mode says so and names
    both ways out (ray[default] on the head, or --driver) instead of Ray's "Failed to connect to Ray"."""
    refused = dapo_job["refused"]
    # requirements/cpu.txt installs plain `ray`: a stack with ray[default] must make this test submit a real job
    assert refused is not None, "this Ray has a job server (ray[default]): test ray_submit.sh's submission instead"
    assert refused.returncode == 2, refused.stdout
    assert "has no job server" in refused.stdout and "ray[default]" in refused.stdout
    assert "bash launch/ray_submit.sh --driver --address HEAD_IP:PORT yaml_configs/cpu_dapo.yaml" in refused.stdout


def test_the_head_made_its_token_where_told_and_left_home_alone(dapo_job):
    """Token authentication as ray_start_head.sh sets it up, with the token file named by RAY_AUTH_TOKEN_PATH
    (created by the script) and ~/.ray/auth_token neither created nor changed."""
    assert dapo_job["token_made"] and dapo_job["home_token_untouched"]
    assert "workers join with: bash launch/ray_start_worker.sh --address 127.0.0.1:" in dapo_job["head_out"]
    assert "run a config with: bash launch/ray_submit.sh --driver --address 127.0.0.1:" in dapo_job["head_out"]


def test_the_cluster_stops_with_the_script_and_leaves_nothing(dapo_job):
    """`ray_stop.sh --temp-dir` on each node (worker, then head) stopped every process of the cluster within its
    grace period (psutil finds none carrying its marker) and the cluster's temp dir is gone."""
    assert dapo_job["left_after_stop"] == [], f"still running after ray_stop.sh: {dapo_job['left_after_stop']}"
    assert dapo_job["stop_output"].count("[ray_stop] stopped") == 2, dapo_job["stop_output"]
    assert "SIGKILL" not in dapo_job["stop_output"], dapo_job["stop_output"]  # every process ended on SIGTERM
    assert wait_gone([dapo_job["base"]]) == []
