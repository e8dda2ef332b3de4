"""Run a function on N local ranks (gloo on CPU, NCCL on GPU) and collect what each returns.

Used by tests, benchmarks and tools that "start their own ranks when not under torchrun". The function must be
importable (module level): ranks start by 'spawn' or 'forkserver' (below). A rank that raises makes the whole
call raise with that rank's traceback; a call that exceeds `timeout_s` kills every rank and raises, so a hung
collective never hangs the caller. Results travel pickled by value. Each rank applies the vendor log level the
caller put in MEGARL_VENDOR_LEVEL (`megarl.platform.vendor_logs.quiet_from_env`) before it imports `fn`'s module
(and so megatron-core).

How ranks start (`MEGARL_RANK_START`): `spawn` (default) starts each rank as a fresh interpreter, which imports
torch, megatron-core and vLLM again (5-15 s a rank on 2 cores); `forkserver` forks each rank from one server process
that imported the modules in `MEGARL_RANK_PRELOAD` (comma-separated) once, so a rank starts in well under a second
(the test suite uses it: tests/conftest.py). A forked rank's environment is the server's (the caller's when the first
`run_ranks` of the process started it) plus `env`; nothing else of the caller's later state reaches it. The server
imports the preloaded modules before any rank applies the vendor log level, so their import-time warnings
(megatron-core's "Apex is not installed") print once, from the server.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import socket
import time
import traceback
from typing import Any, Callable

START_METHOD_ENV = "MEGARL_RANK_START"
PRELOAD_ENV = "MEGARL_RANK_PRELOAD"
START_METHODS = ("spawn", "forkserver")


class RankFailure(RuntimeError):
    """A spawned rank raised, died or timed out; the message carries its traceback or exit code."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, env: dict, fn_ref: bytes, args: tuple, results) -> None:
    """One rank: environment, vendor log level, process group, then `fn` (unpickled from `fn_ref` only now, so the
    imports it pulls in are already quiet)."""
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )
    try:
        from megarl.platform.vendor_logs import quiet_from_env

        quiet_from_env()
        fn = pickle.loads(fn_ref)
        import torch

        torch.set_num_threads(max(1, int(env.get("MEGARL_THREADS_PER_RANK", "1"))))
        from megarl.platform.distributed import init_distributed

        init_distributed()
        out = fn(rank, world_size, *args)
        # by value: a tensor put as is travels as shared memory that the parent maps only while this rank is alive
        # (FileNotFoundError in `rebuild_storage_fd` when the rank has already exited)
        results.put((rank, "ok", pickle.dumps(out)))
    except BaseException:  # report every failure, including KeyboardInterrupt/SystemExit, to the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception as e:  # teardown after a failure must not hide the original error
            print(f"[rank {rank}] process group teardown failed: {e}", flush=True)


def _context():
    method = os.environ.get(START_METHOD_ENV, "spawn")
    if method not in START_METHODS:
        raise ValueError(f"{START_METHOD_ENV}={method!r} is not one of {START_METHODS}")
    ctx = mp.get_context(method)
    if method == "forkserver":  # only takes effect before the server's first start
        ctx.set_forkserver_preload([m for m in os.environ.get(PRELOAD_ENV, "").split(",") if m])
    return ctx


def run_ranks(
    world_size: int, fn: Callable, *args: Any, timeout_s: float = 600.0, env: dict | None = None
) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` fresh processes; return the results in rank order."""
    ctx = _context()
    results = ctx.Queue()
    port = _free_port()
    fn_ref = pickle.dumps(fn)  # by reference (module + name), as multiprocessing would pickle it
    procs = [
        ctx.Process(target=_entry, args=(r, world_size, port, dict(env or {}), fn_ref, args, results), daemon=False)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    errors: list[str] = []
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) + len(errors) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RankFailure(f"ranks timed out after {timeout_s:.0f}s; finished: {sorted(out)}")
            try:
                rank, status, payload = results.get(timeout=min(remaining, 5.0))
            except queue_mod.Empty:
                dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in out]
                if dead and not errors:
                    raise RankFailure(
                        f"rank(s) {dead} died with exit codes {[procs[i].exitcode for i in dead]}"
                    ) from None
                continue
            if status == "ok":
                out[rank] = pickle.loads(payload)
            else:
                errors.append(f"--- rank {rank} ---\n{payload}")
                break  # the others are probably blocked in a collective with the failed rank
        if errors:
            raise RankFailure("a rank failed:\n" + "\n".join(errors))
    finally:
        for p in procs:
            p.join(timeout=10 if not errors else 1)
            if p.is_alive():
                p.kill()
                p.join()
    return [out[r] for r in range(world_size)]
