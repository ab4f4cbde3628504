"""The sandboxed ``python`` tool: normal programs work; endless loops, memory hogs, fork bombs, file access
outside the working directory and network connections are stopped or refused, and the model is told so.

Each case goes through the tool function itself (what the model calls) and checks the text it returns: no
exception escapes, and the text says what happened. Runs take 0.1 to 0.3 s each, the limit tests about 1 s.
The default is the bubblewrap sandbox (CI installs bubblewrap); the weak mode (``weak_sandbox=True``:
unshare namespaces and the Python guard) is tested where its behaviour differs. The attacks on the
boundary itself are in tests/test_sandbox_redteam.py.
"""

from __future__ import annotations

import os
import socket
import time

import pytest

from mmgrpo.toolbox.sandbox import format_result, isolation_level, make_python_tool, run_python

HAS_NS = isolation_level() != "none"
needs_ns = pytest.mark.skipif(not HAS_NS, reason="unshare --user --net --pid does not work here")
needs_tmpfs = pytest.mark.skipif(isolation_level() != "tmpfs", reason="no tmpfs in a mount namespace here")
MODES = [
    pytest.param({}, id="bwrap"),
    pytest.param({"weak_sandbox": True, "namespaces": False}, id="weak-none"),
    pytest.param({"weak_sandbox": True, "namespaces": True}, id="weak-namespaces", marks=needs_ns),
]


@pytest.fixture
def python():
    return make_python_tool(cpu_seconds=1, wall_seconds=5, memory_mb=128, max_output_chars=500)


def live_processes_mentioning(marker: str) -> list[int]:
    """Pids of living (non-zombie) processes whose command line contains ``marker``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if marker.encode() in cmdline:
            found.append(int(entry))
    return found


# ----------------------------------------------------------------------------------------- ordinary code
def test_prints_output(python):
    assert python("print(6 * 7)") == "42"
    assert python("x = sum(i * i for i in range(10))\nprint('sum:', x)") == "sum: 285"


def test_standard_library_and_own_directory_work(python):
    code = (
        "import json, math, fractions, statistics, collections, itertools, re, tempfile, threading, pathlib\n"
        "open('data.txt', 'w').write('3 4 5')\n"
        "nums = [int(x) for x in pathlib.Path('data.txt').read_text().split()]\n"
        "t = threading.Thread(target=lambda: None); t.start(); t.join()\n"
        "with tempfile.NamedTemporaryFile() as f: pass\n"
        "print(json.dumps({'hyp': math.hypot(*nums[:2]), 'frac': str(fractions.Fraction(1, 3) * 3)}))"
    )
    assert python(code) == '{"hyp": 5.0, "frac": "1"}'


def test_no_output_is_explained(python):
    assert "use print()" in python("x = 1")


def test_error_shows_the_traceback_of_the_code_only(python):
    text = python("x = 1\ny = x / 0\n")
    assert 'File "main.py", line 2' in text
    assert "y = x / 0" in text  # the source line is shown
    assert "ZeroDivisionError: division by zero" in text
    assert "<sandbox>" not in text and "_main" not in text and "(exit status 1)" in text


def test_syntax_error(python):
    text = python("print(1 +")
    assert "SyntaxError" in text and "main.py" in text


def test_stdout_is_capped(python):
    text = python("print('x' * 10000)\nprint('never shown')")
    assert len(text) <= 600
    assert "more characters of output not shown" in text


def test_endless_printing_is_stopped():
    result = run_python("while True: print('y' * 1000)", wall_seconds=5)
    assert result.killed_reason == "output limit"
    assert len(result.stdout) <= 2000 and result.stdout_cut > 0
    assert "print less" in format_result(result)


def test_stderr_keeps_the_end():
    result = run_python(
        "import sys\nfor i in range(1000): print(i, file=sys.stderr)\nraise ValueError('last')"
    )
    assert "ValueError: last" in result.stderr and result.stderr_cut > 0


def test_workdir_is_fresh_and_removed():
    import tempfile

    before = {n for n in os.listdir(tempfile.gettempdir()) if n.startswith("mmgrpo-sandbox")}
    code = "import os\nprint(os.getcwd())\nprint(os.listdir('.'))\nopen('left.txt', 'w').write('x')"
    first = run_python(code)
    second = run_python(code)
    assert first.stdout.splitlines()[1] == second.stdout.splitlines()[1] == "['main.py']"  # nothing left over
    # the working directory is a tmpfs in the run's own mount namespace: nothing on the host's disk
    assert {n for n in os.listdir(tempfile.gettempdir()) if n.startswith("mmgrpo-sandbox")} == before


def test_input_reads_nothing(python):
    assert "EOFError" in python("input()")


# ----------------------------------------------------------------------------------------- limits
def test_endless_loop_hits_the_cpu_limit(python):
    start = time.monotonic()
    text = python("while True: pass")
    assert time.monotonic() - start < 4.5  # stopped by the 1 s CPU limit, before the 5 s wall limit
    assert "stopped" in text and "CPU time limit" in text


def test_sleeping_hits_the_wall_limit():
    start = time.monotonic()
    result = run_python("import time\nprint('before', flush=True)\ntime.sleep(60)", wall_seconds=1)
    assert time.monotonic() - start < 3
    assert result.killed_reason == "wall time limit"
    assert result.stdout == "before\n"  # what was printed before the kill is kept (unbuffered output)
    assert "time limit reached" in format_result(result)


@pytest.mark.parametrize(
    "code",
    ["x = bytearray(2 * 1024**3)", "chunks = []\nwhile True: chunks.append(bytearray(10 * 1024**2))"],
    ids=["one-block", "growing"],
)
def test_memory_hog_hits_the_memory_limit(python, code):
    text = python(code)
    assert "memory limit reached" in text


def test_big_file_hits_the_file_size_limit():
    result = run_python("open('big', 'wb').write(b'x' * (3 << 20))", file_size_mb=1)
    assert "File too large" in result.stderr


def test_many_files_hit_the_disk_limit():
    code = "for i in range(100):\n    open(f'f{i}', 'wb').write(b'x' * (1 << 20))"
    result = run_python(code, disk_mb=8, file_size_mb=2)
    assert result.isolation.startswith("bwrap")
    assert "No space left on device" in result.stderr


@needs_tmpfs
def test_many_files_hit_the_disk_limit_in_the_weak_sandbox():
    code = "for i in range(100):\n    open(f'f{i}', 'wb').write(b'x' * (1 << 20))"
    result = run_python(code, disk_mb=8, file_size_mb=2, weak_sandbox=True)
    assert result.isolation == "tmpfs"
    assert "No space left on device" in result.stderr


def test_limits_cannot_be_raised(python):
    assert "not allowed" in python("import resource\nresource.setrlimit(resource.RLIMIT_CPU, (100, 100))")


# ----------------------------------------------------------------------------------------- processes
FORK_BOMBS = {
    "os.fork": "import os\nwhile True:\n    os.fork()",
    "subprocess": "import subprocess\nwhile True:\n    subprocess.Popen(['python3', '-c', 'pass'])",
    "os.system": "import os\nos.system(':(){ :|:& };:')",
    "multiprocessing": "import multiprocessing as mp\nwhile True:\n    mp.Process(target=print).start()",
    "posix_spawn": "import os\nos.posix_spawn('/bin/sh', ['sh'], {})",
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("variant", sorted(FORK_BOMBS))
def test_fork_bomb_is_refused(variant, mode):
    start = time.monotonic()
    result = run_python(FORK_BOMBS[variant], wall_seconds=5, **mode)
    text = format_result(result)
    assert time.monotonic() - start < 3  # refused at once, not stopped by a limit
    assert "starting new processes is not allowed" in text
    assert result.killed_reason is None and result.returncode == 1


@pytest.mark.parametrize("mode", MODES)
def test_processes_started_past_the_guard_die_with_the_run(mode):
    """Without the Python guard (as if native code got around it), forked processes are killed at the wall
    limit: by the process group kill, and in a pid namespace also those that left the group (setsid).
    A bounded number of children: a real fork bomb is not limited by RLIMIT_NPROC when running as root."""
    escape = "os.setsid()" if mode.get("namespaces", True) else "pass"
    code = (
        "import os, time\n"
        "print(os.getcwd(), flush=True)\n"
        "for i in range(8):\n"
        "    if os.fork() == 0:\n"
        f"        {escape}\n"
        "        time.sleep(60)\n"
        "        os._exit(0)\n"
        "time.sleep(60)\n"
    )
    result = run_python(code, wall_seconds=1.5, audit_guard=False, **mode)
    assert result.killed_reason == "wall time limit"
    workdir = result.stdout.strip()  # every process of the run has it in its command line
    assert workdir.startswith("/")
    deadline = time.monotonic() + 3
    while live_processes_mentioning(workdir) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert live_processes_mentioning(workdir) == []
    assert run_python("print('still fine')").stdout == "still fine\n"


def test_signals_to_other_processes_are_refused(python):
    assert "not allowed" in python(f"import os\nos.kill({os.getpid()}, 9)")


# ----------------------------------------------------------------------------------------- files
@pytest.mark.parametrize(
    "how",
    [
        "open({path!r}, 'w').write('x')",
        "import os\nos.close(os.open({path!r}, os.O_WRONLY | os.O_CREAT))",
        "import pathlib\npathlib.Path({path!r}).write_text('x')",
        "import os\nos.chdir(os.path.dirname({path!r}))\nopen(os.path.basename({path!r}), 'w')",
        "import os\nfor _ in range(30): os.chdir('..')\nopen({path!r}.lstrip('/'), 'w')",
        "import shutil\nopen('a', 'w').close()\nshutil.copy('a', {path!r})",
        "import os\nopen('a', 'w').close()\nos.rename('a', {path!r})",
        "import sqlite3\nsqlite3.connect({path!r}).execute('create table t (x)')",
        "import os\nos.mkdir({path!r})",
    ],
    ids=["open", "os.open", "pathlib", "chdir", "relative", "copy", "rename", "sqlite", "mkdir"],
)
def test_writing_outside_is_refused(python, tmp_path, how):
    target = tmp_path / "x_outside"
    text = python(how.format(path=str(target)))
    # refused by the guard, or (bwrap) the path does not exist in the sandbox at all
    assert "outside the working directory is not allowed" in text or "No such file or directory" in text
    assert not target.exists()


def test_links_to_outside_are_refused(python, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("s3cret")
    text = python(f"import os\nos.symlink({str(secret)!r}, 'link')\nprint(open('link').read())")
    assert "not allowed" in text and "s3cret" not in text


@pytest.mark.parametrize(
    "how",
    [
        "print(open({path!r}).read())",
        "import pathlib\nprint(pathlib.Path({path!r}).read_text())",
        "import os\nprint(os.read(os.open({path!r}, os.O_RDONLY), 100))",
        "import os\nos.chdir(os.path.dirname({path!r}))\nprint(open('secret.txt').read())",
        "import os\nprint(os.listdir(os.path.dirname({path!r})))",
        "print(open('/proc/self/root' + {path!r}).read())",
        "import os\nfd = os.open('.', os.O_RDONLY)\nprint(os.read(os.open('../..' + {path!r}, os.O_RDONLY, dir_fd=fd), 99))",
        "import shutil\nshutil.copy({path!r}, 'copy.txt')\nprint(open('copy.txt').read())",
    ],
    ids=["open", "pathlib", "os.open", "chdir", "listdir", "proc-root", "dir_fd", "copy"],
)
def test_reading_outside_is_refused(python, tmp_path, how):
    secret = tmp_path / "secret.txt"
    secret.write_text("s3cret")
    text = python(how.format(path=str(secret)))
    assert "not allowed" in text or "No such file or directory" in text
    assert "s3cret" not in text and "['secret.txt']" not in text  # neither the content nor the listing


def test_system_files_are_not_readable(python):
    assert "is not allowed" in python("print(open('/etc/passwd').read())")
    assert "is not allowed" in python("import os\nprint(os.environ, open('/proc/self/environ').read())")


def test_guard_cannot_be_monkeypatched_away(python, tmp_path):
    """The hook uses functions captured before the code ran: replacing os/posix functions changes nothing."""
    target = tmp_path / "x_outside"
    code = (
        "import os, posix, posixpath\n"
        "os.getcwd = posix.getcwd = lambda: '/'\n"
        "posixpath.realpath = os.path.realpath = lambda p, **k: os.getcwd()\n"
        f"open({str(target)!r}, 'w').write('x')\n"
    )
    assert "not allowed" in python(code)
    assert not target.exists()


@pytest.mark.parametrize(
    "code",
    [
        "import ctypes\nctypes.CDLL(None).system(b'true')",
        "import _xxsubinterpreters\n_xxsubinterpreters.create()",
        "import sys\nsys.settrace(lambda *args: None)",  # a tracer could rewrite the guard's frames
        "import gc\nprint(len(gc.get_objects()))",  # and gc could find its function
    ],
    ids=["ctypes", "subinterpreter", "settrace", "gc"],
)
def test_ways_around_the_guard_are_refused(python, code):
    text = python(code)
    assert "not available" in text or "not allowed" in text


def test_runs_from_many_threads_at_once():
    """The tool runner calls tools from threads: runs are independent and each gets its own output."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda i: run_python(f"print({i} * {i})"), range(8)))
    assert [r.stdout for r in results] == [f"{i * i}\n" for i in range(8)]


# ----------------------------------------------------------------------------------------- network
@pytest.mark.parametrize(
    ("mode", "guard"),
    [
        pytest.param({}, True, id="bwrap"),
        pytest.param({}, False, id="bwrap-no-guard"),
        pytest.param({"weak_sandbox": True, "namespaces": False}, True, id="weak-guard-only"),
        pytest.param(
            {"weak_sandbox": True, "namespaces": True}, False, id="weak-namespace-only", marks=needs_ns
        ),
    ],
)
def test_network_connection_is_refused(mode, guard):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.settimeout(0.3)
        port = listener.getsockname()[1]
        code = (
            "import socket\n"
            f"s = socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
            "s.sendall(b'hello')\n"
            "print('connected')"
        )
        result = run_python(code, audit_guard=guard, **mode)
        text = format_result(result)
        assert "connected" not in result.stdout
        # without the guard: the sandbox's own loopback (bwrap: up, nobody listens) or none (unshare: down)
        unreachable = "Network is unreachable" in text or "Connection refused" in text
        assert ("network access is not allowed" in text) if guard else unreachable
        with pytest.raises(socket.timeout):
            listener.accept()


def test_dns_lookup_is_refused(python):
    assert "network access is not allowed" in python("import socket\nsocket.gethostbyname('example.com')")


# ----------------------------------------------------------------------------------------- arguments
def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="too long"):
        run_python("x = 1\n" * 20_000)
    with pytest.raises(ValueError, match="wall_seconds"):
        run_python("pass", wall_seconds=0)
