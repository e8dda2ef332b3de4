"""The Python executor tool: model-written code run in a local sandbox (issue 23).

    sandbox = PythonSandbox(SandboxLimits(cpu_seconds=5, wall_seconds=10))
    result = await sandbox.arun("print(2 + 2)")      # SandboxResult(ok=True, stdout="4\\n", ...)
    tool = PythonTool(sandbox); text = await tool.python(code)   # what the model sees; never raises

Each run starts a fresh process tree from nothing the worker holds:

    unshare -n -m -p -f -u -i                  network, mount, PID, UTS and IPC namespaces; an unprivileged worker
                                               adds -U -r (a user namespace, uid 0 inside = the worker's uid)
      sh -c <layout>                           PID 1 of the namespace: builds the file system, then
        setpriv (worker is root: --reuid/--regid to the run's own unprivileged uid; no capabilities, no_new_privs)
          timeout -s KILL <wall + 2>           a wall-clock backstop that outlives the worker
            prlimit (cpu, as, nproc, fsize, nofile, core)
              python -I /sandbox/main.py        isolated mode, scrubbed environment, stdin /dev/null

What is isolated, as measured on this machine (kernel 6.18, util-linux 2.38, worker running as root; the
unprivileged variant measured too, as uid 65534 with /usr/bin/python3):
- network: an empty network namespace (only a down `lo`): connect() to 127.0.0.1 or anywhere fails with
  "Network is unreachable"; abstract Unix sockets are per namespace too. The probe at construction checks that the
  child sees no interface but `lo`; if the namespaces cannot be created, construction raises `SandboxUnavailable`
  naming `rollout.env_options.allow_network`, unless `allow_network=True` (then runs are NOT isolated at all, see
  below).
- file system: the child's root is a fresh tmpfs (pivot_root, the old root unmounted), holding only read-only bind
  mounts of /usr, the Python installation (`sys.base_prefix`) and its virtual environment (`sys.prefix`),
  /etc/ld.so.cache (read-only), /dev/{null,zero,random,urandom}, a read-only /proc of its own PID namespace, and
  /sandbox: a fresh tmpfs of `disk_mb`, mode 700 (cwd, HOME, TMPDIR), gone when the run ends. /etc/passwd, the
  worker's files, its temporary directories, /root, /work, the host's /tmp: not there (FileNotFoundError).
- processes: a PID namespace; the child sees only its own tree, can signal nothing outside it, and when the
  namespace's PID 1 exits (the code finished, or it was killed: timeout, cancellation) the kernel kills every
  process left in it, even ones that called setsid(): no stray processes, no zombies.
- privileges: a root worker runs the code as a uid of its own (`FIRST_UID` + ..., no account, owns nothing but
  /sandbox), with no capabilities (bounding set empty, no_new_privs). An unprivileged worker runs it as uid 0 of a
  user namespace (the worker's uid outside), also with every capability dropped. Either way it cannot mount,
  chroot, raise limits or write anything visible but /sandbox.
- limits (prlimit): RLIMIT_CPU (SIGXCPU at `cpu_seconds`, SIGKILL one second later), RLIMIT_AS (`memory_mb` of
  address space per process: allocations raise MemoryError), RLIMIT_NPROC (`max_processes`: a fork bomb gets EAGAIN
  at the limit. Measured: the kernel never applies RLIMIT_NPROC to uid 0 of the host (`unshare -U -r` run by root
  maps to it, and forked 100 children under a limit of 32), hence the run's own uid as root; unprivileged, the
  count is per user namespace (Linux >= 5.14), so the worker's own processes do not count), RLIMIT_FSIZE
  (`file_mb`: larger writes raise OSError EFBIG), RLIMIT_NOFILE, RLIMIT_CORE=0; `wall_seconds` enforced from the
  worker (SIGKILL to the namespace's PID 1, then to the process group) and by `timeout` inside, and nothing is
  awaited past it (output pipes still held once the tree is killed: their holders are killed, then the pipes
  abandoned); stdout+stderr captured up to `output_bytes` in total, the rest read and discarded so the child never
  blocks on a full pipe.

What is NOT isolated:
- memory and CPU are per process (RLIMIT_AS, RLIMIT_CPU), not per sandbox: `max_processes` x `memory_mb` bounds
  the memory (no cgroup is used: cgroup v1 here, not delegated).
- /usr and the Python installation are readable (everything installed in the venv is importable, ctypes
  included: the isolation is the kernel's, not an audit hook's, so ctypes does not bypass it).
- the kernel: no seccomp filter; the sandbox relies on namespaces (and, unprivileged, user namespaces, whose
  kernel attack surface is larger).
- as root, runs share RLIMIT_NPROC with any other process of the same uid: uids repeat after 1000 runs of one
  worker, or across workers whose pids agree modulo 1000 (then two concurrent runs share one `max_processes`).
- an exit status above 128 is read as "killed by signal status-128" (sys.exit(137) reads as killed by signal 9).
- if the worker itself is SIGKILLed mid-run, the code runs on until `timeout` (wall + 2 s) or its CPU limit.
- `allow_network=True` when the namespaces are unavailable: a plain subprocess with the same rlimits (RLIMIT_NPROC
  inert for root), its own temporary directory and a scrubbed environment, but the host's network, file system and
  process table. Its process tree still ends as in a PID namespace: the code runs under a reaper (`_REAPER`, a child
  subreaper, so a descendant that calls setsid() or outlives its parent stays its descendant) that SIGKILLs every
  descendant when the code's process exits, at the wall clock (the worker closes its control pipe), when the worker
  dies, or at wall + 2 s. Code that kills the reaper (same uid: it can) loses that: at the wall clock the worker then
  kills whatever holds the output pipes, and a descendant that closed them and left is not found.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from typing import Optional, Sequence

logger = logging.getLogger("megarl.envs")

# Namespaces of each run (see the module docstring): network, mount, PID (-f: unshare forks, the shell is PID 1), UTS
# and IPC; plus, for an unprivileged worker, a user namespace (-U -r: uid 0 inside = the worker's uid outside).
ROOT_UNSHARE = ("unshare", "-n", "-m", "-p", "-f", "-u", "-i")
USER_UNSHARE = ("unshare", "-U", "-r", "-n", "-m", "-p", "-f", "-u", "-i")
# A root worker runs each sandbox as its own unprivileged uid (RLIMIT_NPROC counts per uid and never binds uid 0):
# FIRST_UID + (pid % 1000) * 1000 + (run % 1000), uids no account uses.
FIRST_UID = 200_000
SANDBOX_DIR = "/sandbox"  # the run's directory, as the child sees it
_READ_CHUNK = 1 << 16


# Sandbox runs in flight at once per event loop (rollout.max_concurrent_sandboxes): the others wait for a slot,
# within their tool call's deadline. Each run is a process tree of its own (up to max_processes x memory_mb).
DEFAULT_MAX_CONCURRENT_RUNS = 8
_max_concurrent_runs = DEFAULT_MAX_CONCURRENT_RUNS
_run_slots: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # event loop -> its asyncio.Semaphore


def set_max_concurrent_runs(runs: int) -> None:
    """Bound the sandbox runs in flight at once (per event loop: the episodes of a batch share one), from
    `rollout.max_concurrent_sandboxes`; loops that already hold a semaphore keep theirs."""
    global _max_concurrent_runs
    if runs < 1:
        raise ValueError(f"rollout.max_concurrent_sandboxes must be >= 1, got {runs}")
    _max_concurrent_runs = runs


def _run_slot() -> asyncio.Semaphore:
    loop = asyncio.get_running_loop()
    slots = _run_slots.get(loop)
    if slots is None:
        slots = _run_slots[loop] = asyncio.Semaphore(_max_concurrent_runs)
    return slots


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot isolate runs (namespaces refused) and the network was not explicitly allowed."""


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    """Per-run limits (`rollout.env_options` of the python environment).

    cpu_seconds: CPU time of each process (RLIMIT_CPU). wall_seconds: wall-clock time of the run, start-up included.
    memory_mb: address space of each process (RLIMIT_AS), MiB. max_processes: processes+threads of the sandbox
    (RLIMIT_NPROC, counted in its user namespace). output_bytes: stdout+stderr kept, bytes, in total (the rest is
    discarded, `truncated` set). file_mb: largest file the code may write (RLIMIT_FSIZE), MiB. disk_mb: size of the
    /sandbox tmpfs, MiB. max_open_files: RLIMIT_NOFILE. allow_network: run without isolation if namespaces are
    unavailable (never disables isolation where it works)."""

    cpu_seconds: int = 5
    wall_seconds: float = 10.0
    memory_mb: int = 512
    max_processes: int = 32
    output_bytes: int = 65536
    file_mb: int = 16
    disk_mb: int = 64
    max_open_files: int = 256
    allow_network: bool = False

    def __post_init__(self) -> None:
        for name in ("cpu_seconds", "wall_seconds", "memory_mb", "max_processes", "output_bytes", "file_mb",
                     "disk_mb", "max_open_files"):
            if getattr(self, name) <= 0:
                raise ValueError(f"rollout.env_options.{name} must be > 0, got {getattr(self, name)}")


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    """One run's outcome. ok: exit status 0, within every limit, output not truncated. stdout/stderr: decoded
    (UTF-8, errors replaced), together at most `output_bytes`. exit_code: the process's (128+N: killed by signal N;
    None: killed by the wall-clock timeout). error: None, or "timeout" | "cpu limit" | "memory limit" |
    "process limit" | "output truncated" | "killed by signal N" | "exit code N". seconds: wall-clock time of the run.
    truncated: output beyond `output_bytes` was discarded."""

    ok: bool
    stdout: str
    stderr: str
    exit_code: Optional[int]
    error: Optional[str]
    seconds: float
    truncated: bool = False


class _Capture:
    """stdout+stderr up to a shared byte budget; everything past it is read and dropped."""

    def __init__(self, budget: int) -> None:
        self.left, self.truncated = budget, False
        self.parts: dict = {"stdout": bytearray(), "stderr": bytearray()}

    async def drain(self, name: str, stream: asyncio.StreamReader) -> None:
        while chunk := await stream.read(_READ_CHUNK):
            keep = chunk[: self.left]
            self.parts[name] += keep
            self.left -= len(keep)
            self.truncated |= len(keep) < len(chunk)

    def text(self, name: str) -> str:
        return bytes(self.parts[name]).decode("utf-8", errors="replace")


def _readonly_dirs(python: str) -> list[str]:
    """Host directories the child needs (read-only): /usr, the Python installation and its venv, no nesting."""
    wanted = ["/usr", os.path.realpath(sys.base_prefix), os.path.realpath(sys.prefix), sys.prefix,
              os.path.dirname(os.path.dirname(os.path.realpath(python)))]
    dirs: list[str] = []
    for path in sorted({os.path.normpath(p) for p in wanted}, key=len):
        if path != "/" and not any(path == d or path.startswith(d + "/") for d in dirs):
            dirs.append(path)
    return dirs


def _layout_script(python: str, limits: SandboxLimits) -> str:
    """The shell run as the namespace's PID 1: the new root ($1/root, a tmpfs), pivot_root, then the limited
    Python. $1: the run's host temporary directory, holding main.py and the empty mount point `root`; $2: the uid
    to run the code as ("": stay uid 0 of the user namespace)."""
    q = shlex.quote
    lines = ["set -e", 'T="$1"', 'R="$T/root"', 'IDS=""', 'OWNER=""',
             'if [ -n "$2" ]; then IDS="--reuid=$2 --regid=$2 --clear-groups"; OWNER=",uid=$2,gid=$2"; fi',
             'mount -t tmpfs -o size=1m,mode=755 sandbox-root "$R"']
    for d in _readonly_dirs(python):
        lines += [f'mkdir -p "$R"{q(d)}', f'mount --rbind {q(d)} "$R"{q(d)}',
                  f'mount -o remount,bind,ro,nosuid,nodev "$R"{q(d)}']
    for name in ("bin", "lib", "lib64", "sbin"):  # merged-/usr symlinks, as the host has them
        if os.path.islink("/" + name):
            lines.append(f'ln -s {q(os.readlink("/" + name))} "$R/{name}"')
    lines += ['mkdir -p "$R/etc" "$R/dev" "$R/proc" "$R/.old" "$R"' + SANDBOX_DIR]
    if os.path.exists("/etc/ld.so.cache"):
        lines += ['touch "$R/etc/ld.so.cache"', 'mount --bind /etc/ld.so.cache "$R/etc/ld.so.cache"',
                  'mount -o remount,bind,ro,nosuid,nodev "$R/etc/ld.so.cache"']
    for dev in ("null", "zero", "random", "urandom"):
        lines += [f'touch "$R/dev/{dev}"', f'mount --bind /dev/{dev} "$R/dev/{dev}"']
    lines += [
        f'mount -t tmpfs -o size={limits.disk_mb}m,mode=700,nosuid,nodev$OWNER sandbox "$R"{SANDBOX_DIR}',
        f'cp "$T/main.py" "$R"{SANDBOX_DIR}/main.py', f'[ -z "$2" ] || chown "$2:$2" "$R"{SANDBOX_DIR}/main.py',
        'cd "$R"', "pivot_root . .old", "mount -t proc -o ro,nosuid,nodev,noexec proc /proc",
        "umount -l /.old", "rmdir /.old", f"cd {SANDBOX_DIR}", "unset OLDPWD",
        # Not exec: the shell stays PID 1, so the Python gets SIGXCPU (PID 1 ignores it) and, when the Python
        # exits, PID 1 exits and the kernel kills whatever the code left running.
        "setpriv $IDS --no-new-privs --inh-caps=-all --bounding-set=-all "
        f"timeout -s KILL {int(limits.wall_seconds) + 2} " + _prlimit(limits) + f" {q(python)} -I main.py",
    ]
    return "\n".join(lines)


def _prlimit(limits: SandboxLimits) -> str:
    mib = 1 << 20
    return (f"prlimit --cpu={limits.cpu_seconds}:{limits.cpu_seconds + 1} --as={limits.memory_mb * mib} "
            f"--nproc={limits.max_processes} --fsize={limits.file_mb * mib} --nofile={limits.max_open_files} "
            "--core=0 --")


def _child_env(home: str) -> dict:
    """The whole environment of the child: nothing inherited (no tokens, no PYTHONPATH)."""
    return {"PATH": "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin", "HOME": home, "TMPDIR": home,
            "LANG": "C.UTF-8", "TZ": "UTC", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1"}


def _classify(exit_code: Optional[int], stderr: str, timed_out: bool, truncated: bool) -> Optional[str]:
    if timed_out:
        return "timeout"
    if exit_code == 128 + signal.SIGXCPU or exit_code == -signal.SIGXCPU:
        return "cpu limit"
    if exit_code and "MemoryError" in stderr[-2000:]:
        return "memory limit"
    if exit_code and "BlockingIOError: [Errno 11]" in stderr:
        return "process limit"
    if exit_code is not None and (exit_code > 128 or exit_code < 0):
        return f"killed by signal {abs(exit_code) - 128 if exit_code > 128 else -exit_code}"
    if exit_code:
        return f"exit code {exit_code}"
    if truncated:
        return "output truncated"
    return None


# The unisolated fallback's parent of the code (`python -I -c _REAPER BACKSTOP_S ARGV...`, stdin: the worker's
# control pipe, stdout/stderr: the capture pipes). A child subreaper: every descendant of the code, even one that
# called setsid() or whose parent exited, stays its descendant, so it can find and SIGKILL them all (by /proc's
# ppid links, until it has no child left). It does so when the code's process exits (as PID 1 of a namespace ends its
# tree), when the control pipe reads EOF (the worker hit the wall clock, was cancelled, or died), or BACKSTOP_S after
# its start; then it exits with the code's status (128+N: killed by signal N; 124: the backstop).
_REAPER = r"""
import ctypes, os, select, signal, subprocess, sys, time
if ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) != 0:  # PR_SET_CHILD_SUBREAPER
    sys.exit(f"sandbox reaper: prctl(PR_SET_CHILD_SUBREAPER) failed: {os.strerror(ctypes.get_errno())}")
backstop = time.monotonic() + float(sys.argv[1])
code = subprocess.Popen(sys.argv[2:], stdin=subprocess.DEVNULL, process_group=0)
exited = os.pidfd_open(code.pid)
while (left := backstop - time.monotonic()) > 0:
    ready = select.select([0, exited], [], [], left)[0]
    if exited in ready or (0 in ready and not os.read(0, 4096)):
        break
status = code.poll()

def live_descendants():
    children = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        state, ppid = stat[stat.rindex(b")") + 2:].split()[:2]
        if state != b"Z":
            children.setdefault(int(ppid), []).append(int(entry))
    found, todo = [], [os.getpid()]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found

while True:  # until no child is left: then no descendant is (each has a chain of parents up to a child of ours)
    for pid in live_descendants():
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.waitpid(-1, 0)
    except ChildProcessError:
        break
if status is None:
    sys.exit(124)
sys.exit(128 - status if status < 0 else status)
"""
_STOP_GRACE_S = 5.0  # at the wall clock: the longest wait for the reaper to kill the code's tree and exit
_PIPE_GRACE_S = 1.0  # then for the output pipes to close (read to EOF), before killing their holders / abandoning them

_PROBE = "import socket; print(','.join(n for _, n in socket.if_nameindex()))"


class PythonSandbox:
    """Runs Python code in a fresh, isolated process tree (module docstring: what is and is not isolated).

    python: the interpreter (default: this one; its installation and venv are mounted read-only). unshare_cmd: the
    namespace prefix (default `ROOT_UNSHARE` as root, else `USER_UNSHARE`); probed once here with a trivial run:
    if it fails, or the child sees a network interface other than `lo`, construction raises `SandboxUnavailable`
    unless `limits.allow_network` (then runs are not isolated: `self.isolated` is False)."""

    def __init__(self, limits: SandboxLimits = SandboxLimits(), python: Optional[str] = None,
                 unshare_cmd: Optional[Sequence[str]] = None) -> None:
        self.limits = limits
        self.python = python or sys.executable
        self.as_root = os.geteuid() == 0
        self.unshare_cmd = list(unshare_cmd or (ROOT_UNSHARE if self.as_root else USER_UNSHARE))
        self.isolated = True
        self._runs = 0
        self._script = _layout_script(self.python, limits)
        failure = self._probe()
        if failure is not None:
            if not limits.allow_network:
                raise SandboxUnavailable(
                    f"the Python sandbox cannot isolate runs: {failure}. It needs user, network, mount and PID "
                    f"namespaces ({' '.join(self.unshare_cmd)}; util-linux unshare, pivot_root, setpriv, prlimit). "
                    "Set rollout.env_options.allow_network=true to run model code WITHOUT network or file-system "
                    "isolation (rlimits and a temporary directory only).")
            logger.warning("Python sandbox NOT isolated (rollout.env_options.allow_network=true): %s", failure)
            self.isolated = False

    def _probe(self) -> Optional[str]:
        if shutil.which(self.unshare_cmd[0]) is None:
            return f"{self.unshare_cmd[0]!r} not found"
        result = self.run(_PROBE)
        if not result.ok:
            return f"a trivial run failed ({result.error}): {(result.stderr or result.stdout).strip()[-500:]}"
        interfaces = result.stdout.strip()
        if interfaces not in ("", "lo"):
            return f"the child still sees network interfaces {interfaces!r}"
        return None

    def run(self, code: str) -> SandboxResult:
        """Run `code` to completion (blocking; from a coroutine use `arun`)."""
        return asyncio.run(self.arun(code))

    async def arun(self, code: str) -> SandboxResult:
        """Run `code` in a fresh sandbox; never raises for anything the code does. At most
        `rollout.max_concurrent_sandboxes` runs at once (`set_max_concurrent_runs`); the others wait for a slot."""
        async with _run_slot():
            return await self._arun(code)

    async def _arun(self, code: str) -> SandboxResult:
        start = time.monotonic()
        tmp = tempfile.mkdtemp(prefix="megarl-sandbox-")
        try:
            with open(os.path.join(tmp, "main.py"), "w", encoding="utf-8") as f:
                f.write(code)
            if self.isolated:
                os.mkdir(os.path.join(tmp, "root"))
                self._runs += 1
                uid = str(FIRST_UID + (os.getpid() % 1000) * 1000 + self._runs % 1000) if self.as_root else ""
                argv = [*self.unshare_cmd, "sh", "-c", self._script, "sh", tmp, uid]
                env, cwd = _child_env(SANDBOX_DIR), tmp
            else:  # the reaper (module docstring): the code's whole tree ends with the code, or at the wall clock
                argv = [sys.executable, "-I", "-c", _REAPER, str(int(self.limits.wall_seconds) + 2),
                        *shlex.split(_prlimit(self.limits)), self.python, "-I", "main.py"]
                env, cwd = _child_env(tmp), tmp
            return await self._execute(argv, env, cwd, start)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    async def _execute(self, argv: list, env: dict, cwd: str, start: float) -> SandboxResult:
        limits = self.limits
        loop = asyncio.get_running_loop()
        # Our own pipes (not asyncio's): their inodes name whoever still holds them, and we can close them.
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        control_r, control_w = os.pipe() if not self.isolated else (subprocess.DEVNULL, -1)
        pipe_inodes = {os.fstat(out_r).st_ino, os.fstat(err_r).st_ino}
        files = {"stdout": os.fdopen(out_r, "rb", 0), "stderr": os.fdopen(err_r, "rb", 0)}
        readers, transports = {}, []
        try:
            for name, file in files.items():
                reader = readers[name] = asyncio.StreamReader(loop=loop)
                transport, _ = await loop.connect_read_pipe(
                    lambda reader=reader: asyncio.StreamReaderProtocol(reader, loop=loop), file)
                transports.append(transport)
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=control_r, stdout=out_w, stderr=err_w, env=env, cwd=cwd, start_new_session=True)
        except BaseException:
            for transport in transports:
                transport.close()
            for file in files.values():
                file.close()
            if control_w >= 0:
                os.close(control_w)
            raise
        finally:  # the child holds the write ends (and the reaper the control pipe's read end) now
            for fd in (out_w, err_w) + ((control_r,) if control_w >= 0 else ()):
                os.close(fd)
        capture = _Capture(limits.output_bytes)
        io = asyncio.gather(capture.drain("stdout", readers["stdout"]), capture.drain("stderr", readers["stderr"]),
                            proc.wait())
        timed_out = False
        try:
            await asyncio.wait_for(asyncio.shield(io), timeout=limits.wall_seconds)
        except asyncio.TimeoutError:
            timed_out = True
        finally:  # timeout, or the episode cancelled: the whole tree goes, and nothing is awaited past the kill
            if not io.done():
                if control_w >= 0:
                    os.close(control_w)  # the reaper: kill every descendant, then exit
                    control_w = -1
                    if not await _bounded(proc.wait(), _STOP_GRACE_S, "the sandbox reaper to kill the code and exit"):
                        _kill(os.killpg, proc.pid)
                else:
                    await _kill_tree(proc)
                # Its tree is dead; whoever still holds the pipes escaped it (e.g. the code killed its reaper, then
                # a setsid()'d child): killed too, then the pipes are abandoned (their writers get EPIPE).
                if not await _bounded(asyncio.shield(io), _PIPE_GRACE_S, "the sandbox's output pipes to close"):
                    _kill_pipe_holders(pipe_inodes)
                    if not await _bounded(asyncio.shield(io), _PIPE_GRACE_S,
                                          "the sandbox's output pipes to close after killing their holders"):
                        io.cancel()
                        await asyncio.wait([io], timeout=_PIPE_GRACE_S)  # the drains stop at their next await
            if control_w >= 0:
                os.close(control_w)
            for transport in transports:
                transport.close()
            if io.done() and not io.cancelled():
                io.exception()  # retrieved: a drain's error (none expected) is not logged as never retrieved
        stdout, stderr = capture.text("stdout"), capture.text("stderr")
        if timed_out:  # unshare's own complaint when its child is SIGKILLed: not the code's output
            stderr = "".join(line for line in stderr.splitlines(keepends=True) if not line.startswith("unshare: "))
        exit_code = None if timed_out else proc.returncode
        error = _classify(exit_code, stderr, timed_out, capture.truncated)
        return SandboxResult(ok=error is None, stdout=stdout, stderr=stderr, exit_code=exit_code, error=error,
                             seconds=time.monotonic() - start, truncated=capture.truncated)


async def _bounded(awaitable, seconds: float, what: str) -> bool:
    """Wait at most `seconds` for `awaitable`; False (logged, naming `what`) if it did not finish."""
    try:
        await asyncio.wait_for(awaitable, timeout=seconds)
        return True
    except asyncio.TimeoutError:
        logger.warning("Python sandbox: gave up after %.0f s waiting for %s", seconds, what)
        return False


def _kill_pipe_holders(inodes: set) -> None:
    """SIGKILL every process that holds one of the pipes `inodes` (by /proc/<pid>/fd), the worker excepted."""
    targets = {f"pipe:[{inode}]" for inode in inodes}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            fds = os.listdir(f"/proc/{entry}/fd")
            if any(os.readlink(f"/proc/{entry}/fd/{fd}") in targets for fd in fds):
                _kill(os.kill, int(entry))
        except OSError:  # gone, or not ours to look at
            continue


async def _kill_tree(proc: asyncio.subprocess.Process) -> None:
    """SIGKILL the namespace's PID 1 (unshare's child): the kernel kills everything in the PID namespace and unshare,
    its parent, reaps it, so no orphan is left to the host's init; then unshare's process group."""
    if proc.returncode is None:
        try:
            with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
                children = [int(c) for c in f.read().split()]
        except OSError:
            children = []
        for child in children:
            _kill(os.kill, child)
        if children:
            try:
                await asyncio.wait_for(asyncio.shield(proc.wait()), timeout=2.0)
            except asyncio.TimeoutError:
                pass
    _kill(os.killpg, proc.pid)


def _kill(kill, pid: int) -> None:
    try:
        kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class PythonTool:
    """The `python` tool a model calls: runs code in `sandbox` and returns what the model reads, never raising.

    Output: stdout, then stderr; on an error the first line is a short message (e.g. "Error: timed out after
    10 s"). `counters`: calls, ok, errors, and per error kind timeouts / cpu_limits / memory_limits /
    process_limits / killed / exit_errors, plus truncations (a truncated output also counts as an error)."""

    name = "python"
    _KIND = {"timeout": "timeouts", "cpu limit": "cpu_limits", "memory limit": "memory_limits",
             "process limit": "process_limits", "output truncated": "truncations"}

    def __init__(self, sandbox: PythonSandbox) -> None:
        self.sandbox = sandbox
        self.counters = dict.fromkeys(
            ("calls", "ok", "errors", "timeouts", "cpu_limits", "memory_limits", "process_limits", "killed",
             "exit_errors", "truncations"), 0)

    def schema(self) -> dict:
        """The JSON schema passed to the chat template's `tools=`."""
        return {"type": "function", "function": {
            "name": self.name,
            "description": "Run Python 3 code in a fresh sandbox (no network, no files kept between calls) and "
                           "return its stdout and stderr. Print what you want to see.",
            "parameters": {"type": "object", "properties": {"code": {"type": "string", "description": "the code"}},
                           "required": ["code"]}}}

    async def python(self, code: str) -> str:
        """Run `code`; the text the model sees."""
        self.counters["calls"] += 1
        try:
            result = await self.sandbox.arun(code)
        except Exception as e:  # the worker's side failed (e.g. out of file descriptors): still an observation
            logger.exception("python tool: the sandbox failed")
            self.counters["errors"] += 1
            return f"Error: the sandbox failed ({type(e).__name__})"
        return self._render(result)

    def _render(self, r: SandboxResult) -> str:
        if r.truncated:
            self.counters["truncations"] += 1
        if r.ok:
            self.counters["ok"] += 1
            return r.stdout + r.stderr
        self.counters["errors"] += 1
        kind = self._KIND.get(r.error or "")
        if kind and kind != "truncations":
            self.counters[kind] += 1
        elif (r.error or "").startswith("killed"):
            self.counters["killed"] += 1
        elif (r.error or "").startswith("exit code"):
            self.counters["exit_errors"] += 1
        lim = self.sandbox.limits
        message = {
            "timeout": f"timed out after {lim.wall_seconds:g} s",
            "cpu limit": f"CPU time limit ({lim.cpu_seconds} s) exceeded",
            "memory limit": f"memory limit ({lim.memory_mb} MB) exceeded",
            "process limit": f"process limit ({lim.max_processes}) reached",
            "output truncated": f"output truncated to {lim.output_bytes} bytes",
        }.get(r.error or "", r.error)
        body = r.stdout + r.stderr
        if r.truncated and r.error != "output truncated":
            body += f"\n[output truncated to {lim.output_bytes} bytes]"
        return f"Error: {message}\n{body}".rstrip("\n") + "\n"
