"""The Python sandbox against hostile code (megarl/envs/sandbox.py): each case stopped, reported as an error, and
the test process unharmed with no process left behind. Needs the namespaces the sandbox needs (a sandbox that
cannot isolate fails; the refusal and fallback tests simulate their absence). No wall-clock assertion: a limit is
shown by its classification, concurrency by order of events, cleanup by counting processes."""

import asyncio
import gc
import json
import os
import resource
import signal
import socket
import sys
import time
import uuid

import psutil  # requirements/test.txt
import pytest

from megarl.envs.sandbox import FIRST_UID, PythonSandbox, PythonTool, SandboxLimits, SandboxUnavailable

LIMITS = SandboxLimits(cpu_seconds=1, wall_seconds=2.0, memory_mb=256, max_processes=16, output_bytes=4096)


@pytest.fixture(scope="module")
def sandbox():
    # No skip: user, network, mount and PID namespaces work on every machine this project runs on (DESIGN.md: `unshare
    # -n` as root, `unshare -U -r -n` without); a sandbox that cannot isolate here is a failure, not a missing feature.
    return PythonSandbox(LIMITS)


@pytest.fixture(scope="module")
def open_sandbox():
    """The unisolated fallback (`allow_network`, namespaces simulated away): same limits, the host's process table."""
    box = PythonSandbox(SandboxLimits(**{**LIMITS.__dict__, "allow_network": True}), unshare_cmd=["/bin/false"])
    assert not box.isolated
    return box


@pytest.fixture(autouse=True)
def unharmed():
    """After each test: no child of ours left that the test started (zombie or not; children other tests of the
    session left, e.g. a multiprocessing resource tracker, are not ours to judge), we can still fork."""
    before = {k.pid for k in psutil.Process().children(recursive=True)}
    yield
    deadline = time.monotonic() + 2.0
    while (kids := [k for k in psutil.Process().children(recursive=True) if k.pid not in before]) \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    assert kids == [], [(k.pid, k.name(), k.status()) for k in kids]
    ours = range(FIRST_UID + (os.getpid() % 1000) * 1000, FIRST_UID + (os.getpid() % 1000 + 1) * 1000)
    escaped = [p.info for p in psutil.process_iter(["pid", "uids", "status"]) if p.info["uids"].real in ours]
    assert escaped == []  # nothing run as a sandbox uid of this process survives (e.g. after setsid())
    pid = os.fork()
    if pid == 0:
        os._exit(7)
    assert os.waitpid(pid, 0)[1] >> 8 == 7


def test_normal_code_prints_its_result(sandbox):
    r = sandbox.run("import math\nprint(math.factorial(10))")
    assert r.ok and r.error is None and r.exit_code == 0 and r.stdout == "3628800\n" and not r.truncated


def test_exception_is_reported_not_raised(sandbox):
    r = sandbox.run("1/0")
    assert not r.ok and r.error == "exit code 1" and "ZeroDivisionError" in r.stderr


def test_infinite_loop_stopped_by_cpu_limit(sandbox):
    r = sandbox.run("while True: pass")  # 1 s of CPU, unless the machine is so busy the 2 s wall clock comes first
    assert not r.ok and r.error in ("cpu limit", "timeout")
    assert sandbox.run("print('alive')").stdout == "alive\n"


def test_sleeping_code_stopped_by_wall_clock(sandbox):
    r = sandbox.run("import time\nprint('before', flush=True)\ntime.sleep(60)")
    assert r.error == "timeout" and r.exit_code is None and r.stdout == "before\n"  # it ran, then the clock ended it
    tool = PythonTool(sandbox)
    assert tool._render(r) == "Error: timed out after 2 s\nbefore\n" and tool.counters["timeouts"] == 1


def test_fork_bomb_stopped_by_process_limit(sandbox):
    r = sandbox.run("import os\nwhile True: os.fork()")
    assert not r.ok and r.error in ("process limit", "timeout")
    assert "Resource temporarily unavailable" in r.stderr or r.error == "timeout"


def test_persistent_fork_bomb_held_at_the_limit_then_killed(sandbox):
    code = ("import os\nn = 0\nfor _ in range(1000):\n    try:\n        os.fork() or os.kill(os.getpid(), 19)\n"
            "        n += 1\n    except OSError:\n        break\nprint('forked', n, flush=True)\n"
            "os.setsid()\nwhile True:\n    try: os.fork()\n    except OSError: pass")
    r = sandbox.run(code)  # the spinning parent: its CPU limit or the wall clock, whichever first
    assert r.error in ("cpu limit", "timeout")
    forked = int(r.stdout.split()[1])
    assert forked < LIMITS.max_processes, r.stdout


def test_memory_bomb_gets_memory_error(sandbox):
    r = sandbox.run("x = bytearray(4 << 30)")
    assert not r.ok and r.error == "memory limit" and "MemoryError" in r.stderr


def test_100_mb_of_output_truncated_to_the_cap(sandbox):
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    code = "import sys\nfor _ in range(100): sys.stdout.write('x' * (1 << 20))\nprint('done', file=sys.stderr)"
    r = sandbox.run(code)
    assert r.truncated and r.error == "output truncated" and not r.ok and r.exit_code == 0
    assert len(r.stdout.encode()) + len(r.stderr.encode()) <= LIMITS.output_bytes
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before < 50 * 1024  # KiB: 100 MB never held


# Everything the sandbox may show, from its documented rules (megarl/envs/sandbox.py's docstring, "file system"): a
# tmpfs root holding read-only bind mounts of /usr, the Python installation and its venv (`BINDS`), the directories
# leading down to them, the merged-/usr symlinks, /etc/ld.so.cache, /dev/{null,zero,random,urandom}, its own /proc,
# and /sandbox holding main.py. The code below lists, from inside, every mount and every path (not descending into the
# binds, whose identity with the host's directory is checked instead, nor /proc, a proc file system of its own PID
# namespace); it stops listing after 2000 paths (a host tree left visible must not run into the CPU limit).
_ENUMERATE = """
import json, os
BINDS = {binds!r}
mounts = []
for line in open("/proc/self/mountinfo"):
    fields, fs = line.split(" - ", 1)
    fields = fields.split()
    mounts.append(dict(point=fields[4].encode().decode("unicode_escape"), fstype=fs.split()[0], options=fields[5]))
paths, unreadable = [], []
for top, dirs, files in os.walk("/", onerror=lambda e: unreadable.append(e.filename)):
    paths += [os.path.join(top, name) for name in dirs + files]
    dirs[:] = [d for d in dirs if os.path.join(top, d) not in BINDS + ["/proc"]]
    if len(paths) > 2000:
        break
identity = dict((b, [os.stat(b).st_dev, os.stat(b).st_ino]) for b in BINDS)
print(json.dumps(dict(mounts=mounts, paths=paths, unreadable=unreadable, identity=identity)))
"""


DEVICES = ("null", "zero", "random", "urandom")


def _documented_binds() -> list:
    """/usr, the Python installation (the interpreter's real location, and `sys.base_prefix`) and the venv, nested
    ones dropped."""
    installation = os.path.dirname(os.path.dirname(os.path.realpath(sys.executable)))
    wanted = {"/usr", installation, sys.base_prefix, sys.prefix, os.path.realpath(sys.base_prefix),
              os.path.realpath(sys.prefix)}
    binds: list = []
    for path in sorted(map(os.path.normpath, wanted), key=len):
        if not any(path == b or path.startswith(b + "/") for b in binds):
            binds.append(path)
    return binds


def test_the_sandbox_sees_only_what_it_documents(tmp_path):
    """Enumerates the sandbox's whole file system and mount table from inside and compares them with the documented
    allow-list; markers written on the host (its /tmp, this checkout) never show up. Its own sandbox: the listing
    (a few KB, up to 2000 paths when something is wrong) does not fit the shared one's 4 KB of output."""
    sandbox = PythonSandbox(SandboxLimits(**{**LIMITS.__dict__, "output_bytes": 1 << 20}))
    binds = _documented_binds()
    marker = f"megarl-sandbox-marker-{uuid.uuid4().hex}"
    host_markers = [tmp_path / marker, os.path.join(os.path.dirname(os.path.abspath(__file__)), marker)]
    for path in host_markers:
        open(path, "w").write("host content")
    try:
        r = sandbox.run(_ENUMERATE.format(binds=binds))
    finally:
        os.remove(host_markers[1])
    assert r.ok, r
    assert sandbox.run("import os\nprint(os.getcwd(), os.environ.get('PYTHONPATH'))").stdout == "/sandbox None\n"
    seen = json.loads(r.stdout)
    host_submounts = set()  # mounts the host has below a bind come along with it (rbind)
    for line in open("/proc/self/mountinfo"):
        point = line.split()[4].encode().decode("unicode_escape")
        host_submounts |= {point} if any(point.startswith(b + "/") for b in binds) else set()
    mounts = {m["point"]: m for m in seen["mounts"]}
    allowed = {"/", "/proc", "/sandbox", "/etc/ld.so.cache", *binds, *host_submounts} | {f"/dev/{d}" for d in DEVICES}
    assert set(mounts) <= allowed, sorted(set(mounts) - allowed)  # e.g. the old root left mounted at /.old
    assert [mounts[point]["fstype"] for point in ("/", "/sandbox", "/proc")] == ["tmpfs", "tmpfs", "proc"]
    assert all("ro" in mounts[b]["options"].split(",") for b in binds)
    assert len(seen["mounts"]) == len(mounts)  # nothing mounted twice over a documented point

    assert not [p for p in seen["paths"] if marker in p]
    expected = {"/etc", "/dev", "/proc", "/sandbox", "/sandbox/main.py"} | {f"/dev/{d}" for d in DEVICES}
    expected |= {"/etc/ld.so.cache"} if os.path.exists("/etc/ld.so.cache") else set()
    expected |= {"/" + name for name in ("bin", "lib", "lib64", "sbin") if os.path.islink("/" + name)}
    for bind in binds:  # the bind itself and every directory above it
        expected |= {bind[:i] for i in range(1, len(bind) + 1) if i == len(bind) or bind[i] == "/"} - {""}
    assert set(seen["paths"]) == expected, {"not documented": sorted(set(seen["paths"]) - expected)[:20],
                                            "missing": sorted(expected - set(seen["paths"]))}
    assert seen["unreadable"] == []  # a directory it could not list would be a hole in the enumeration
    # each bind is the host's own directory (same device and inode), mounted read-only
    assert seen["identity"] == {b: [os.stat(b).st_dev, os.stat(b).st_ino] for b in binds}



def test_visible_files_are_read_only(sandbox):
    import sys
    r = sandbox.run(f"open({os.path.join(sys.prefix, 'megarl-sandbox-test')!r}, 'w')")
    assert not r.ok and ("Read-only file system" in r.stderr or "PermissionError" in r.stderr)


def test_socket_to_localhost_fails_and_listener_gets_nothing(sandbox):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(0.2)
    port = listener.getsockname()[1]
    try:
        r = sandbox.run(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)")
        assert not r.ok and "Network is unreachable" in r.stderr
        with pytest.raises(socket.timeout):
            listener.accept()
    finally:
        listener.close()


def test_each_run_gets_a_fresh_directory(sandbox):
    r = sandbox.run("open('state.txt', 'w').write('x')\nimport os\nprint(os.listdir('.'))")
    assert r.ok and "state.txt" in r.stdout
    r = sandbox.run("import os\nprint(os.path.exists('state.txt'))")
    assert r.stdout == "False\n"


def _catching_sigusr1(pid: int) -> bool:
    """Whether process `pid` has a handler for SIGUSR1 (its /proc status's SigCgt mask)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    except (OSError, StopIteration):
        return False
    return bool(mask >> (signal.SIGUSR1 - 1) & 1)


def test_runs_are_concurrent():
    """Four runs, each waiting for a signal that the test sends only once it sees all four waiting at once: runs one
    after another would each wait for the signal until their wall clock (timeout)."""
    box = PythonSandbox(SandboxLimits(**{**LIMITS.__dict__, "wall_seconds": 20.0}))  # a slow start is no failure
    code = ("import signal, threading\nreceived = threading.Event()\n"
            "signal.signal(signal.SIGUSR1, lambda *_: received.set())\nreceived.wait()\nprint('ok')")

    def waiting() -> list:
        found = []
        for p in psutil.Process().children(recursive=True):
            try:
                if p.cmdline()[-2:] == ["-I", "main.py"] and _catching_sigusr1(p.pid):
                    found.append(p.pid)
            except psutil.Error:
                continue
        return found

    async def four():
        runs = [asyncio.ensure_future(box.arun(code)) for _ in range(4)]
        while len(pids := waiting()) < 4 and not any(run.done() for run in runs):
            await asyncio.sleep(0.05)
        if len(pids) < 4:  # one ended (its wall clock) before all four waited: the rest need not run theirs
            for run in runs:
                run.cancel()
            return pids, await asyncio.gather(*runs, return_exceptions=True)
        for pid in pids:
            os.kill(pid, signal.SIGUSR1)
        return pids, await asyncio.gather(*runs)

    pids, results = asyncio.run(four())
    assert len(pids) == 4, f"never saw four runs waiting at once: {results}"
    assert [(r.error, r.stdout) for r in results] == [(None, "ok\n")] * 4


# A child that calls setsid() and keeps stdout/stderr open, then runs as `sleep` with MARK in its command line; the
# code goes on (prints "parent True") once the child has exec'd (its copy of a close-on-exec pipe closed) and /proc
# shows the MARK in its command line.
_SETSID_CHILD = """import os, sys
ready_r, ready_w = os.pipe()
pid = os.fork()
if pid == 0:
    os.setsid()
    print('child', flush=True)
    os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(600)', {mark!r}])
os.close(ready_w)
os.read(ready_r, 1)
print('parent', {mark!r}.encode() in open(f'/proc/{{pid}}/cmdline', 'rb').read(), flush=True)
"""


def _run_bounded(box, code: str, mark: str):
    """`box.run(code)`, failing (not hanging) if it has not returned 30 s after its 2 s wall clock; then kills what
    the test started that is still there and returns (result, how many processes with `mark` were left)."""
    def marked() -> list:
        return [p for p in psutil.process_iter(["cmdline"]) if mark in (p.info["cmdline"] or [])]

    async def bounded():
        return await asyncio.wait_for(box.arun(code), timeout=LIMITS.wall_seconds + 30)

    try:
        result = asyncio.run(bounded())
    except asyncio.TimeoutError:
        result = None
        # the abandoned run's transports are finalized here, not by a GC inside pytest's ast.parse of this file
        # (CPython 3.11.7 then fails that parse: "AST constructor recursion depth mismatch", an INTERNALERROR)
        gc.collect()
    left = marked()
    for p in left:
        p.kill()
    assert result is not None, f"the run did not return 30 s past its wall clock; left running: {left}"
    return result, len(left)


@pytest.mark.parametrize("isolated", [True, False], ids=["isolated", "allow_network"])
def test_setsid_child_holding_the_pipes_ends_at_the_wall_clock(isolated, sandbox, open_sandbox):
    """The code sleeps; its setsid()'d child keeps the output pipes: the run ends as a timeout, the child with it."""
    mark = f"megarl-setsid-{uuid.uuid4().hex}"
    code = _SETSID_CHILD.format(mark=mark) + "import time\ntime.sleep(600)"
    r, left = _run_bounded(sandbox if isolated else open_sandbox, code, mark)
    assert (r.error, r.exit_code, r.stdout, left) == ("timeout", None, "child\nparent True\n", 0)


@pytest.mark.parametrize("isolated", [True, False], ids=["isolated", "allow_network"])
def test_setsid_child_ends_with_the_code(isolated, sandbox, open_sandbox):
    """The code exits at once, leaving a setsid()'d child on the pipes: the run is the code's (ok) and the child is
    killed as when a PID namespace's init exits."""
    mark = f"megarl-setsid-{uuid.uuid4().hex}"
    r, left = _run_bounded(sandbox if isolated else open_sandbox, _SETSID_CHILD.format(mark=mark), mark)
    assert (r.error, r.stdout, left) == (None, "child\nparent True\n", 0)


def test_setsid_child_of_code_that_killed_its_reaper_is_still_killed(open_sandbox):
    """Unisolated, the code can kill its reaper: at the wall clock the worker kills whatever holds the output pipes."""
    mark = f"megarl-setsid-{uuid.uuid4().hex}"
    code = _SETSID_CHILD.format(mark=mark) + "import time\nos.kill(os.getppid(), 9)\ntime.sleep(600)"
    r, left = _run_bounded(open_sandbox, code, mark)
    assert (r.error, r.stdout, left) == ("timeout", "child\nparent True\n", 0)


def test_refuses_without_isolation_unless_network_allowed():
    with pytest.raises(SandboxUnavailable, match="rollout.env_options.allow_network"):
        PythonSandbox(LIMITS, unshare_cmd=["/bin/false"])
    open_box = PythonSandbox(SandboxLimits(allow_network=True, cpu_seconds=1, wall_seconds=3),
                             unshare_cmd=["/bin/false"])
    assert not open_box.isolated
    r = open_box.run("import os\nprint(6 * 7, os.environ.get('PYTHONPATH'))")
    assert r.ok and r.stdout == "42 None\n"


def test_tool_reports_errors_as_text_and_counts_them(sandbox):
    tool = PythonTool(sandbox)

    async def calls():
        return await asyncio.gather(tool.python("print(1 + 1)"), tool.python("import os\nwhile True: os.fork()"),
                                    tool.python("x = bytearray(4 << 30)"), tool.python("print('y' * 10**6)"),
                                    tool.python("raise ValueError('bad')"))

    ok, bomb, memory, big, exc = asyncio.run(calls())
    assert ok == "2\n"
    assert bomb.startswith("Error: process limit (16) reached") and "BlockingIOError" in bomb
    assert memory.startswith("Error: memory limit (256 MB) exceeded") and "MemoryError" in memory
    assert big.startswith("Error: output truncated to 4096 bytes") and len(big) < 4200
    assert exc.startswith("Error: exit code 1") and "ValueError: bad" in exc
    c = tool.counters
    assert (c["calls"], c["ok"], c["errors"], c["process_limits"], c["memory_limits"], c["truncations"],
            c["exit_errors"]) == (5, 1, 4, 1, 1, 1, 1)
    assert tool.schema()["function"]["name"] == "python"


def test_the_python_environment_runs_a_models_tool_call_in_the_sandbox():
    """`rollout.env: python`: a Hermes tool call parsed from a model turn runs in the sandbox and its output is the
    tool message; a hostile call is an error message and counted, and the episode goes on."""
    import asyncio

    from megarl.data.dataset import PromptRecord
    from megarl.envs import ModelTurn, build_env_factory, get_parser

    env = build_env_factory("python", {"reward_fn": "exact_match", "wall_seconds": 3.0, "cpu_seconds": 2})()
    parse = get_parser("hermes")

    async def episode():
        await env.reset(PromptRecord(0, "6*7=", "42", {}))
        text = '<tool_call>{"name": "python", "arguments": {"code": "print(6*7)"}}</tool_call>'
        calls, errors = parse(text)
        first = await env.step(ModelTurn(0, text, (), tuple(calls), tuple(errors)))
        text = '<tool_call>{"name": "python", "arguments": {"code": "while True: pass"}}</tool_call>'
        calls, errors = parse(text)
        second = await env.step(ModelTurn(1, text, (), tuple(calls), tuple(errors)))
        last = await env.step(ModelTurn(2, "42", ()))
        return first, second, last

    first, second, last = asyncio.run(episode())
    assert first.observations[0]["content"] == "42\n" and first.observations[0]["name"] == "python"
    assert second.observations[0]["content"].startswith("Error:") and not second.done
    assert last.done and last.reward == 1.0
    counters = env.toolset.counters()
    assert counters["python/calls"] == 2 and counters["python/errors"] == 1, counters


def test_concurrent_runs_are_bounded_by_max_concurrent_sandboxes(sandbox, monkeypatch):
    """rollout.max_concurrent_sandboxes=2: five runs started at once, never more than two in flight (counted inside
    the run, after its slot), all five finish."""
    import megarl.envs.sandbox as sandbox_module

    inner, in_flight, most = PythonSandbox._arun, [0], [0]

    async def counted(self, code):
        in_flight[0] += 1
        most[0] = max(most[0], in_flight[0])
        try:
            return await inner(self, code)
        finally:
            in_flight[0] -= 1

    monkeypatch.setattr(PythonSandbox, "_arun", counted)
    monkeypatch.setattr(sandbox_module, "_max_concurrent_runs", 2)

    async def five():
        return await asyncio.gather(*(sandbox.arun("print(1)") for _ in range(5)))

    results = asyncio.run(five())
    assert [r.stdout for r in results] == ["1\n"] * 5
    assert most[0] == 2
