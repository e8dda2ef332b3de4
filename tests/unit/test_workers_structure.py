"""The worker hosts' structure (issue 21, item 1): every role method is written once, in `RoleHost`, and every
group that hosts roles exposes it under the same name and dispatch mode; no engine host offers the batch `generate`
worker call (issue 31: every rollout goes through the request servers); the rollout services' weight pushes.

Read with `ast` from the sources (no torch / megatron import needed) and, for the dispatch marks, from the classes.
"""

from __future__ import annotations

import ast
import pathlib

from megarl.controller.dispatch import dispatched_methods
from megarl.rollout.service import ColocatedRollout

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "megarl"
ROLE_METHODS = ("compute_log_probs", "compute_ref_log_probs", "compute_values", "score", "update_actor",
                "update_critic", "save_checkpoint", "load_checkpoint")
ROLLOUT_METHODS = ("start_server", "stop_server", "server_submit", "server_abort", "server_poll", "server_alive",
                   "shm_segments")


def method_definitions(root: pathlib.Path) -> dict[str, list[str]]:
    """method name -> ['module:Class', ...] for every method defined in a class under `root` (a `typing.Protocol`
    only declares methods: not counted)."""
    out: dict[str, list[str]] = {}
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and not any(getattr(b, "id", getattr(b, "attr", None)) == "Protocol"
                                                          for b in node.bases):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        out.setdefault(item.name, []).append(f"{path.relative_to(root.parent)}:{node.name}")
    return out


def test_every_role_and_rollout_method_is_defined_once_across_workers_and_trainer():
    defs = {}
    for sub in ("workers", "trainer"):
        for name, where in method_definitions(PACKAGE / sub).items():
            defs.setdefault(name, []).extend(where)
    for name in ROLE_METHODS:
        assert defs.get(name) == ["workers/role_host.py:RoleHost"], (name, defs.get(name))
    for name in ROLLOUT_METHODS:
        assert defs.get(name) == ["workers/rollout_host.py:RolloutHost"], (name, defs.get(name))


def test_the_checker_sees_a_copied_method(tmp_path):
    pkg = tmp_path / "megarl" / "workers"
    pkg.mkdir(parents=True)
    (pkg / "a.py").write_text("class RoleHost:\n    def score(self): ...\n")
    (pkg / "b.py").write_text("class HybridWorker:\n    def score(self): ...\n")
    (pkg / "c.py").write_text("from typing import Protocol\nclass Scores(Protocol):\n    def score(self): ...\n")
    assert sorted(method_definitions(pkg)["score"]) == ["workers/a.py:RoleHost", "workers/b.py:HybridWorker"]


def test_role_groups_expose_the_same_methods_with_the_same_dispatch():
    from megarl.workers.hybrid import HybridWorker
    from megarl.workers.role_host import RoleHost, RoleWorker

    host = dispatched_methods(RoleHost)
    for cls in (HybridWorker, RoleWorker):
        methods = dispatched_methods(cls)
        for name in ROLE_METHODS:
            assert methods[name] is host[name], (cls.__name__, name)
            assert getattr(cls, name) is getattr(RoleHost, name)
    hybrid = dispatched_methods(HybridWorker)
    assert {"start_server", "stop_server", "sync_weights", "shm_segments", "process_info"} <= set(hybrid)
    assert "generate" not in hybrid  # the request path only (issue 31)
    assert not {"start_server", "sync_weights"} & set(dispatched_methods(RoleWorker))  # no engine on a role's pool


# ------------------------------------------------------------------------------------------- ColocatedRollout
class _FakeGroup:
    """The `sync_weights` of a HybridWorker group with `replicas` replicas."""

    def __init__(self, replicas: int) -> None:
        self.replicas, self.pushed = replicas, 0
        self.sync_weights = _Dispatched(self._sync_weights)

    def _sync_weights(self):
        self.pushed += 1
        return [{"reshard/bytes_received": 1.0}] * self.replicas


class _Dispatched:
    """A controller method as `WorkerGroup` exposes it: callable, and `.submit(...)` -> an object with `result()`."""

    def __init__(self, fn) -> None:
        self.fn = fn

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)

    def submit(self, *args, **kwargs):
        answer = self.fn(*args, **kwargs)
        return type("Answered", (), {"result": lambda _self: answer})()


def test_push_weights_is_the_local_reshard_and_records_the_version():
    group = _FakeGroup(2)
    service = ColocatedRollout(group)
    assert service.weight_version is None
    assert service.push_weights(version=0) == [{"reshard/bytes_received": 1.0}] * 2
    assert group.pushed == 1 and service.weight_version == 0


# ------------------------------------------------------------------------------------------- PoolRollout
def test_pool_workers_expose_the_role_and_sync_methods():
    from megarl.workers.pool_sync import ActorWorker, RolloutWorker
    from megarl.workers.role_host import RoleHost

    actor, engines = dispatched_methods(ActorWorker), dispatched_methods(RolloutWorker)
    for name in ROLE_METHODS:
        assert actor[name] is dispatched_methods(RoleHost)[name]
    assert {"connect_bridge", "send_weights", "sync_source"} <= set(actor) and "start_server" not in actor
    assert {"connect_bridge", "receive_weights", "start_server", "stop_server", "shm_segments"} <= set(engines)
    assert "generate" not in engines
    assert not set(ROLE_METHODS) & set(engines)


class _Call:
    def __init__(self, log, what, value):
        self.log, self.what, self.value = log, what, value

    def result(self):
        self.log.append(("wait", self.what))
        return self.value


class _Method:
    def __init__(self, log, what, value):
        self.log, self.what, self.value = log, what, value

    def submit(self, version):
        self.log.append(("submit", self.what, version))
        return _Call(self.log, self.what, self.value)


def _report(sent, received, verified, planned, lower=0.0):
    return {"reshard/bytes_sent": sent, "reshard/bytes_received": received, "reshard/bytes_lower_bound": lower,
            "reshard/time_s": 0.5 + sent / 1e3, "reshard/verified_pieces": verified,
            "reshard/planned_pieces": planned}


def test_pool_push_submits_both_sides_before_waiting_and_summarises_per_rank():
    from types import SimpleNamespace

    from megarl.rollout.service import PoolRollout

    log = []
    actors = SimpleNamespace(send_weights=_Method(log, "send", [_report(300, 0, 0, 0), _report(100, 0, 0, 0)]))
    engines = _FakeGroup(2)
    engines.receive_weights = _Method(log, "receive", [_report(0, 200, 5, 5, 200), _report(0, 200, 5, 5, 200)])
    service = PoolRollout(actors, engines)
    out = service.push_weights(version=3)
    assert log[:2] == [("submit", "send", 3), ("submit", "receive", 3)]  # both in flight before either is waited
    assert service.weight_version == 3 and len(out) == 1 + 2 + 2
    s = out[0]
    assert (s["reshard/pool/sent_max_bytes"], s["reshard/pool/sent_mean_bytes"]) == (300, 200)
    assert (s["reshard/pool/received_max_bytes"], s["reshard/pool/received_mean_bytes"]) == (200, 200)
    assert s["reshard/pool/sent_bytes_rank1"] == 100 and s["reshard/pool/received_bytes_rank0"] == 200
    assert s["reshard/pool/lower_bound_bytes"] == 400 and s["reshard/pool/verified"] == 1.0
    assert s["reshard/time_s"] == 0.8  # the slowest rank's
    engines.receive_weights.value = [_report(0, 200, 5, 5), _report(0, 200, 4, 5)]  # one piece unchecked
    assert service.push_weights(version=4)[0]["reshard/pool/verified"] == 0.0
