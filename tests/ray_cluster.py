"""One local Ray cluster for the suite's `megarl train` runs that do not test a run's own cluster.

A `megarl train` that finds RAY_ADDRESS joins that cluster instead of starting one (`megarl.trainer.session`), as it
does under `launch/ray_submit.sh`. Starting and stopping a local cluster costs each run ~4-5 s on the 2-core
machine (GCS, raylet and their agents are Python processes of their own: `ray.init` 2.5-4.1 s, `ray.shutdown`
~1.3 s, measured 2026-12-03 on a 2-core Intel Xeon), so the runs whose checks are about training (resume, rollout
correction, the MoE quickstart, heterogeneous placement, the HF-family runs) share one. The runs that check the
life cycle of their own cluster -- signals, a killed worker, the first screen, the README example as a user runs
it -- keep starting their own.

The cluster: `ray start --head` in a short temp dir of its own (Ray's unix sockets live under it: paths must stay
under ~107 characters), on free ports, no dashboard, no token auth (RAY_AUTH_MODE=disabled for it and for the runs
that join it: the test machine's own ~/.ray is never touched); stopped by terminating exactly the processes that
run under that temp dir (`ray stop` would stop every Ray cluster of this user on the machine).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import psutil

from tests.subprocess_env import clean_env

START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 30.0
TERM_GRACE_S = 3.0  # measured: ray's processes exit on SIGTERM within it, but one may ignore SIGTERM for 30 s


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalRayCluster:
    """A head node started with `ray start --head`; `env()` is `clean_env()` joined to it."""

    def __init__(self, num_cpus: int = 4) -> None:
        self.temp_dir = tempfile.mkdtemp(prefix="mrray", dir="/tmp")
        self.port = _free_port()
        self.address = f"127.0.0.1:{self.port}"
        ray = os.path.join(os.path.dirname(sys.executable), "ray")
        cmd = [ray, "start", "--head", f"--port={self.port}", f"--num-cpus={num_cpus}", f"--temp-dir={self.temp_dir}",
               "--include-dashboard=false", "--disable-usage-stats", f"--ray-client-server-port={_free_port()}"]
        try:
            proc = subprocess.run(cmd, env=self._ray_env(), capture_output=True, text=True, timeout=START_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.stop()
            raise RuntimeError(f"`ray start --head` did not return within {START_TIMEOUT_S:.0f} s") from None
        if proc.returncode != 0:
            self.stop()
            raise RuntimeError(f"`ray start --head` failed ({proc.returncode}): {proc.stderr[-2000:]}")

    def _ray_env(self) -> dict[str, str]:
        return dict(clean_env(), RAY_AUTH_MODE="disabled")

    def env(self) -> dict[str, str]:
        """The environment of a `megarl train` run that joins this cluster."""
        return dict(self._ray_env(), RAY_ADDRESS=self.address)

    def processes(self) -> list[psutil.Process]:
        out = []
        for p in psutil.process_iter(["cmdline"]):
            try:
                if any(self.temp_dir in arg for arg in p.info["cmdline"] or ()):
                    out.append(p)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        return out

    def stop(self) -> None:
        """Terminate every process running under this cluster's temp dir (then kill what is left after
        TERM_GRACE_S), wait up to STOP_TIMEOUT_S for all of them to be gone and remove the dir."""
        procs = self.processes()
        for p in procs:
            try:
                p.terminate()
            except psutil.NoSuchProcess:
                pass
        _, alive = psutil.wait_procs(procs, timeout=TERM_GRACE_S)
        for p in alive:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while self.processes() and time.monotonic() < deadline:
            time.sleep(0.2)
        shutil.rmtree(self.temp_dir, ignore_errors=True)
