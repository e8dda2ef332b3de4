"""Ray clusters the tests start on this machine, and the helpers they share (free ports, finding a cluster's
processes, stopping them, bounded waits).

`LocalRayCluster` -- one head node for the suite's `megarl train` runs that do not test a run's own cluster.
A `megarl train` that finds RAY_ADDRESS joins that cluster instead of starting one (`megarl.trainer.session`), as it
does under `launch/ray_submit.sh --driver`. Starting and stopping a local cluster costs each run ~4-5 s on the 2-core
machine (GCS, raylet and their agents are Python processes of their own: `ray.init` 2.5-4.1 s, `ray.shutdown`
~1.3 s, measured 2026-12-03 on a 2-core Intel Xeon), so the runs whose checks are about training (resume, rollout
correction, the MoE quickstart, heterogeneous placement, the HF-family runs) share one. The runs that check the
life cycle of their own cluster -- signals, a killed worker, the first screen, the README example as a user runs
it -- keep starting their own. It is `ray start --head` in a short temp dir of its own (Ray's unix sockets live under
it: paths must stay under ~107 characters), on free ports, no dashboard, no token auth (RAY_AUTH_MODE=disabled for
it and for the runs that join it: the test machine's own ~/.ray is never touched); stopped by terminating exactly
the processes whose command line names that temp dir (`ray stop` would stop every Ray cluster of this user on the
machine).

`ScriptCluster` -- several "nodes" started and stopped with the scripts in launch/ as a user runs them:
`ray_start_head.sh`, `ray_start_worker.sh --address HEAD:PORT`, `ray_submit.sh [--driver] CONFIG ...`, `ray_stop.sh
--temp-dir DIR` on each node. Several raylets share this host the way `ray.cluster_utils.Cluster` lets them, but each
"node" is a separate `ray start` with its own temp dir (so its own session, sockets, logs and log monitor), every
listening port picked free (none of Ray's defaults: 6379, 8265, 10001, 52365 may belong to a user's cluster on this
machine), node IP 127.0.0.1, a small object store and `cpus_per_node` logical CPUs. The token of Ray 2.60's token
authentication is a file in the cluster's temp dir (RAY_AUTH_TOKEN_PATH; the head script creates it), so ~/.ray is
never read or written. Every process the cluster starts inherits MEGARL_TEST_RAY_CLUSTER=<its temp dir> from the
scripts' environment (raylets, GCS, dashboard, agents, workers, the controller): `processes()` finds them by it,
whatever title Ray gives a worker, so a test can assert that none is left after the stop.

Every wait is bounded and its error names what it waited for.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from typing import Callable, Optional

import psutil

from tests.subprocess_env import clean_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RAY_BIN = os.path.join(os.path.dirname(sys.executable), "ray")  # this venv's, as once it is activated


# -- shared helpers -----------------------------------------------------------------------------------------------

def free_ports(n: int) -> list[int]:
    """`n` distinct TCP ports free on 127.0.0.1 right now (all held open until all are chosen)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def find_processes(match: Callable[[psutil.Process], bool]) -> list[psutil.Process]:
    """The live processes (this one excepted) for which `match(process)` holds; a process that exits or denies
    access meanwhile is skipped."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.pid != os.getpid() and match(p):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def end_processes(procs: list[psutil.Process], term_grace_s: Optional[float], kill_wait_s: float = 10.0) -> list[str]:
    """SIGTERM `procs`, then SIGKILL those still alive after `term_grace_s` (None: SIGKILL at once) and wait up to
    `kill_wait_s` for them to vanish (0: not at all, for a caller that waits in its own way). Returns 'pid command
    line' of each process that had to be killed."""
    if term_grace_s is not None:
        for p in procs:
            try:
                p.terminate()
            except psutil.NoSuchProcess:
                pass
        _, procs = psutil.wait_procs(procs, timeout=term_grace_s)
    killed = []
    for p in procs:
        try:
            name = f"{p.pid} {' '.join(p.cmdline())[:120]}"
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            name = str(p.pid)
        try:
            p.kill()
            killed.append(name)
        except psutil.NoSuchProcess:
            pass
    if kill_wait_s > 0:
        psutil.wait_procs(procs, timeout=kill_wait_s)
    return killed


def wait_until(done: Callable[[], bool], timeout_s: float, interval_s: float = 0.2) -> bool:
    """Poll `done()` until it holds or `timeout_s` passes; whether it held."""
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval_s)
    return True


def wait_gone(paths: list[str], timeout_s: float = 10.0) -> list[str]:
    """The paths among `paths` that still exist after up to `timeout_s`."""
    wait_until(lambda: not any(os.path.exists(p) for p in paths), timeout_s)
    return [p for p in paths if os.path.exists(p)]


def _tail(text: str, n: int = 3000) -> str:
    return text[-n:] if text else "(empty)"


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


# -- the suite's shared cluster -----------------------------------------------------------------------------------

class LocalRayCluster:
    """A head node started with `ray start --head`; `env()` is `clean_env()` joined to it."""

    START_TIMEOUT_S = 120.0
    STOP_TIMEOUT_S = 30.0
    TERM_GRACE_S = 3.0  # measured: ray's processes exit on SIGTERM within it, but one may ignore SIGTERM for 30 s

    def __init__(self, num_cpus: int = 7) -> None:
        """`num_cpus`: logical CPUs (Ray's accounting only: one per worker slot of a pool); 7 = the largest session
        that joins it (tests/e2e/multi_turn_runs.py: actor 2 + rollout 2 + two teacher pools of 1 + a judge pool of
        1)."""
        self.temp_dir = tempfile.mkdtemp(prefix="mrray", dir="/tmp")
        self.port, client_port = free_ports(2)
        self.address = f"127.0.0.1:{self.port}"
        cmd = [RAY_BIN, "start", "--head", f"--port={self.port}", f"--num-cpus={num_cpus}",
               f"--temp-dir={self.temp_dir}", "--include-dashboard=false", "--disable-usage-stats",
               f"--ray-client-server-port={client_port}"]
        try:
            proc = subprocess.run(cmd, env=self._ray_env(), capture_output=True, text=True,
                                  timeout=self.START_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.stop()
            raise RuntimeError(f"`ray start --head` did not return within {self.START_TIMEOUT_S:.0f} s") from None
        if proc.returncode != 0:
            self.stop()
            raise RuntimeError(f"`ray start --head` failed ({proc.returncode}): {proc.stderr[-2000:]}")

    def _ray_env(self) -> dict[str, str]:
        return dict(clean_env(), RAY_AUTH_MODE="disabled")

    def env(self) -> dict[str, str]:
        """The environment of a `megarl train` run that joins this cluster."""
        return dict(self._ray_env(), RAY_ADDRESS=self.address)

    def processes(self) -> list[psutil.Process]:
        """The processes whose command line names this cluster's temp dir."""
        return find_processes(lambda p: any(self.temp_dir in arg for arg in p.cmdline()))

    def stop(self) -> None:
        """Terminate every process running under this cluster's temp dir (then kill what is left after
        TERM_GRACE_S), wait up to STOP_TIMEOUT_S for all of them to be gone and remove the dir."""
        end_processes(self.processes(), self.TERM_GRACE_S, kill_wait_s=0)  # waited for below, by command line
        wait_until(lambda: not self.processes(), self.STOP_TIMEOUT_S)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


# -- a cluster of several nodes, run with launch/'s scripts ---------------------------------------------------------

class ScriptCluster:
    """A head node and worker nodes started with launch/'s scripts; `stop()` stops them with launch/ray_stop.sh.

    Use as a context manager: on exit the cluster is stopped (if not already), any process of it still alive is
    killed, and its temp dir is removed, however the test ended."""

    MARK = "MEGARL_TEST_RAY_CLUSTER"
    OBJECT_STORE_BYTES = 128 * 1024**2

    def __init__(self, cpus_per_node: int = 1, start_timeout_s: float = 120.0) -> None:
        # Short, not under pytest's tmp_path: Ray's unix sockets live in <temp dir>/session_<date>_<pid>/sockets/
        # and a socket path must stay under 108 bytes.
        self.base = tempfile.mkdtemp(prefix="mrl-ray-", dir="/tmp")
        self.cpus_per_node = cpus_per_node
        self.start_timeout_s = start_timeout_s
        self.node_dirs: list[str] = []  # the head's first
        self.gcs_port, self.dashboard_port, self._client_port = free_ports(3)
        self.env = clean_env()
        bin_dir = os.path.dirname(sys.executable)  # `ray` and `megarl` of this venv, as once it is activated
        self.env.update(PATH=f"{bin_dir}:{self.env.get('PATH', '')}", RAY_AUTH_MODE="token",
                        RAY_AUTH_TOKEN_PATH=os.path.join(self.base, "auth_token"), **{self.MARK: self.base})
        self.stopped = False
        self.stop_output = ""

    # -- addresses ----------------------------------------------------------------------------------------------

    @property
    def gcs_address(self) -> str:
        return f"127.0.0.1:{self.gcs_port}"

    @property
    def dashboard_address(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    # -- start --------------------------------------------------------------------------------------------------

    def _node_flags(self, name: str) -> list[str]:
        node_dir = os.path.join(self.base, name)
        self.node_dirs.append(node_dir)
        (agent_port,) = free_ports(1)
        return ["--node-ip-address", "127.0.0.1", "--temp-dir", node_dir, "--num-cpus", str(self.cpus_per_node),
                "--object-store-memory", str(self.OBJECT_STORE_BYTES), "--dashboard-agent-listen-port",
                str(agent_port), "--min-worker-port", "0", "--max-worker-port", "0", "--disable-usage-stats"]

    def _script(self, script: str, *args: str, timeout_s: float, what: str) -> subprocess.CompletedProcess:
        try:
            proc = subprocess.run(["bash", os.path.join("launch", script), *args], cwd=ROOT, env=self.env,
                                  capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired as e:
            raise AssertionError(f"{what}: `launch/{script}` did not return within {timeout_s:.0f} s; output: "
                                 f"{_tail((e.stdout or b'').decode() + (e.stderr or b'').decode())}") from None
        assert proc.returncode == 0, (f"{what}: launch/{script} exited {proc.returncode}: "
                                      f"{_tail(proc.stdout + proc.stderr)}")
        return proc

    def start_head(self) -> subprocess.CompletedProcess:
        return self._script("ray_start_head.sh", "--port", str(self.gcs_port), "--dashboard-port",
                            str(self.dashboard_port), "--ray-client-server-port", str(self._client_port),
                            *self._node_flags("head"), timeout_s=self.start_timeout_s, what="the head node")

    def add_worker(self, address: Optional[str] = None) -> subprocess.CompletedProcess:
        """Start worker node `worker<i>` joining `address` (default: this cluster's head)."""
        name = f"worker{len(self.node_dirs)}"
        return self._script("ray_start_worker.sh", "--address", address or self.gcs_address, *self._node_flags(name),
                            timeout_s=self.start_timeout_s, what=f"worker node {name}")

    # -- Ray's view of the cluster (the GCS, from a driver subprocess with the cluster's token) ---------------------

    def _probe(self, code: str, timeout_s: float, what: str) -> dict:
        """Run `code` (a driver joining the cluster's GCS; the dashboard's HTTP API needs ray[default], which this
        stack does not install) in a subprocess; the JSON it prints last."""
        try:
            proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=self.env, capture_output=True,
                                  text=True, timeout=timeout_s + 60)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{what}: the probe did not return within {timeout_s + 60:.0f} s") from None
        assert proc.returncode == 0, f"{what}: {_tail(proc.stderr)}"
        return json.loads(proc.stdout.strip().splitlines()[-1])

    def wait_for_nodes(self, n: int, timeout_s: float = 60.0) -> list[dict]:
        """Block until `n` nodes are alive in the cluster (each raylet registered with the head's GCS); their
        {node_id, is_head, resources}. Raises AssertionError naming the nodes started, the nodes that joined and
        the tail of each raylet log when `timeout_s` passes first."""
        code = f"""
import json, time
import ray
ray.init(address={self.gcs_address!r}, log_to_driver=False, logging_level="ERROR")
deadline = time.monotonic() + {timeout_s}
while True:
    alive = [x for x in ray.nodes() if x["Alive"]]
    if len(alive) >= {n} or time.monotonic() > deadline:
        break
    time.sleep(0.5)
print(json.dumps([dict(node_id=x["NodeID"], is_head="node:__internal_head__" in x["Resources"],
                       resources=x["Resources"]) for x in alive]))
"""
        nodes = self._probe(code, timeout_s, f"waiting for {n} alive nodes at {self.gcs_address}")
        if len(nodes) < n:
            logs = {os.path.basename(d): _tail(_read(os.path.join(d, "session_latest", "logs", "raylet.out")), 400)
                    for d in self.node_dirs}
            raise AssertionError(f"only {len(nodes)} of {n} Ray nodes joined the cluster at {self.gcs_address} within "
                                 f"{timeout_s:.0f} s (alive: {nodes}); nodes started: {self.node_dirs}; raylet.out "
                                 f"tails: {logs}")
        return nodes

    def actors(self, class_name: str) -> list[dict]:
        """Every actor of `class_name` the cluster has had, alive or dead: {actor_id, node_id, pid, state}."""
        code = f"""
import json
import ray
from ray._private.state import actors
ray.init(address={self.gcs_address!r}, log_to_driver=False, logging_level="ERROR")
print(json.dumps([dict(actor_id=a["ActorID"], node_id=a["Address"]["NodeID"], pid=a["Pid"], state=a["State"])
                  for a in actors().values() if a["ActorClassName"] == {class_name!r}]))
"""
        return self._probe(code, 60.0, f"listing the cluster's {class_name} actors")

    def job_server(self) -> bool:
        """Whether this Ray install runs the dashboard's job server (ray[default]); `ray_submit.sh` needs it."""
        code = "import json, ray._private.utils as u; print(json.dumps(u.get_dashboard_dependency_error() is None))"
        return self._probe(code, 30.0, "checking for ray[default]")

    # -- the controller -------------------------------------------------------------------------------------------

    def submit(self, *train_args: str, driver: bool = False, submission_id: Optional[str] = None,
               timeout_s: float = 600.0) -> subprocess.CompletedProcess:
        """`bash launch/ray_submit.sh CONFIG [key=value ...]`, waiting for the run to end; stdout and stderr
        together in `.stdout`.

        driver=False: job mode, `--address DASHBOARD --submission-id ID` (its output streams the job's driver log;
            exit status 1 if the job failed, 2 if this install cannot submit jobs).
        driver=True: `--driver --address GCS`: the controller runs in the script's process on this machine,
            attached to the cluster; its exit status is the run's."""
        mode = ["--driver", "--address", self.gcs_address] if driver else [
            "--address", self.dashboard_address, *(["--submission-id", submission_id] if submission_id else [])]
        cmd = ["bash", "launch/ray_submit.sh", *mode, *train_args]
        try:
            return subprocess.run(cmd, cwd=ROOT, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            raise AssertionError(f"`{' '.join(cmd[1:])}` did not end within {timeout_s:.0f} s; log so far: "
                                 f"{_tail(out)}") from None

    # -- stop -----------------------------------------------------------------------------------------------------

    def processes(self) -> list[psutil.Process]:
        """This cluster's live processes (their environment holds MEGARL_TEST_RAY_CLUSTER=<its temp dir>)."""
        return find_processes(lambda p: p.environ().get(self.MARK) == self.base)

    def stop(self, timeout_s: float = 60.0) -> str:
        """`bash launch/ray_stop.sh --temp-dir DIR` on every node, workers first, the head last (as a user stops a
        cluster); the scripts' combined output."""
        out = []
        for node_dir in reversed(self.node_dirs):
            out.append(self._script("ray_stop.sh", "--temp-dir", node_dir, timeout_s=timeout_s,
                                    what=f"stopping node {os.path.basename(node_dir)}").stdout)
        self.stopped = True
        self.stop_output = "".join(out)
        return self.stop_output

    def kill_leftovers(self) -> list[str]:
        """SIGKILL whatever of this cluster is still alive; what was killed (empty after a clean stop)."""
        return end_processes(self.processes(), term_grace_s=None)

    def __enter__(self) -> "ScriptCluster":
        return self

    def __exit__(self, *exc) -> None:
        try:
            if not self.stopped and self.node_dirs:
                try:
                    self.stop()
                except AssertionError:
                    pass  # killed below
        finally:
            self.kill_leftovers()
            shutil.rmtree(self.base, ignore_errors=True)
