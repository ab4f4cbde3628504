"""Red team: model-written code tries to get out of the python tool's sandbox, one test per class of attack
found against the old sandbox (issue 19). Every attack runs with the Python guard switched off
(``audit_guard=False``), since code can switch it off from inside: what holds here is the operating
system's boundary (bubblewrap, seccomp, cgroups). Each is refused or contained, the tool returns an
observation, and the caller goes on. They need bubblewrap (`apt-get install bubblewrap`; .ci/run installs it).
(The HTTP tools' attacks, slow headers and compression bombs, are in tests/test_http_tools.py.)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import pytest

from mmgrpo.errors import ConfigError
from mmgrpo.toolbox import bwrap, cgroups
from mmgrpo.toolbox.sandbox import format_result, make_python_tool, run_python
from mmgrpo.tools import ToolRunner
from mmgrpo.tools.visible import visible

ROOT = Path(__file__).resolve().parents[1]


def test_the_strong_sandbox_is_available_here():
    """The suite needs bubblewrap (README; .ci/run installs it): without it every test below would only show
    the python tool refusing to start. This says why, in one line."""
    assert bwrap.problem() is None


def run(code: str, **limits) -> tuple[str, object]:
    """The observation the model would get, and the result; the guard is off (as if tampered with)."""
    result = run_python(textwrap.dedent(code), audit_guard=False, **limits)
    return format_result(result, 4000), result


def sandbox_processes(programs_only: bool = False) -> list[int]:
    """Host pids of living processes of a sandbox run (their command lines name /sandbox/main.py); with
    ``programs_only``, only the sandboxed interpreter's, not the launcher (sh, setpriv) or bwrap's own."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
                state = Path(f"/proc/{entry}/stat").read_text().split(")")[-1].split()[0]
            except OSError:
                continue
            launcher = os.path.basename(cmdline.split(b"\0")[0]) in (b"sh", b"setpriv", b"bwrap")
            if b"/sandbox/main.py" in cmdline and state != "Z" and not (programs_only and launcher):
                found.append(int(entry))
    return found


def uids_of(pid: int) -> list[str] | None:
    """Real, effective, saved and filesystem uid of ``pid`` on the host, or None when it is gone."""
    try:
        return Path(f"/proc/{pid}/status").read_text().split("Uid:")[1].split("\n")[0].split()
    except (OSError, IndexError):
        return None


# ------------------------------------------------------------------- the guard switched off changes nothing
def test_code_without_the_guard_cannot_reach_the_trainer_its_environment_or_the_host(tmp_path):
    """The old escape: tamper with the audit hook, then write a .pth into the trainer's site-packages (it ran
    as root in the next process). Now the trainer's environment, the project and the host's files are not
    there at all, and what is there is read-only."""
    purelib = sysconfig.get_paths()["purelib"]
    secret = tmp_path / "secret.txt"
    secret.write_text("s3cret")
    targets = {
        "pth": f"{purelib}/mmgrpo_evil.pth",
        "project": str(ROOT / "README.md"),
        "secret": str(secret),
        "passwd": "/etc/passwd",
        "root": "/root/x",
        "usr": "/usr/bin/mmgrpo-evil",
    }
    text, result = run(
        f"""
        import json, os
        out = {{}}
        for name, path in {targets!r}.items():
            for mode in ("r", "w"):
                try:
                    with open(path, mode) as f:
                        f.write("import os") if mode == "w" else f.read()
                    out[name + mode] = "DONE"
                except OSError as e:
                    out[name + mode] = type(e).__name__
        out["listing"] = sorted(os.listdir("/"))
        print(json.dumps(out))
        """
    )
    out = json.loads(result.stdout)
    assert "DONE" not in out.values(), out
    # the interpreter's prefix is there when it lives outside /usr (a non-root trainer's pyenv: /root/...)
    prefixes = {p.split("/")[1] for p in bwrap.boundary().interpreter.prefixes if not p.startswith("/usr/")}
    assert out["listing"] == sorted({"bin", "dev", "lib", "lib64", "sandbox", "sbin", "usr"} | prefixes)
    assert not Path(targets["pth"]).exists() and not Path("/usr/bin/mmgrpo-evil").exists()
    assert "s3cret" not in text


# ------------------------------------------------------------------------------------------- native code
def test_native_code_written_to_the_working_directory_cannot_run():
    """A shared object written into the working directory (here: a copy of a stdlib extension under a new
    name) cannot be mapped, and a program written there cannot be started."""
    text, result = run(
        """
        import glob, importlib.machinery, importlib.util, os, shutil, sys
        lib = sorted(glob.glob([p for p in sys.path if p.endswith("lib-dynload")][0] + "/*.so"))[0]
        shutil.copy(lib, "evil.so")
        name = os.path.basename(lib).split(".")[0]
        try:
            spec = importlib.util.spec_from_file_location(name, "evil.so")
            importlib.util.module_from_spec(spec)
            print("LOADED so")
        except Exception as e:
            print("so refused:", type(e).__name__, e)
        shutil.copy("/usr/bin/true", "evil")
        os.chmod("evil", 0o755)
        try:
            os.execv("./evil", ["evil"])
        except OSError as e:
            print("exec refused:", type(e).__name__, e)
        """
    )
    assert "LOADED" not in text and "so refused" in text, text
    assert "exec refused: PermissionError" in text, text


def test_native_code_from_the_stdlib_tree_or_the_system_cannot_be_loaded():
    """ctypes can still call what is already mapped, but no new library can be mapped (no PROT_EXEC after
    start-up), and raw system calls through it meet the seccomp filter."""
    text, result = run(
        """
        import ctypes, glob, os
        def loaded(path):  # already mapped: dlopen would map nothing new
            try:
                return bool(ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_NOW))
            except OSError:
                return False
        libs = [p for p in sorted(glob.glob("/usr/lib/*-linux-gnu/lib*.so.*")) if not loaded(p)]
        try:
            ctypes.CDLL(libs[0])
            print("LOADED", libs[0])
        except OSError as e:
            print("dlopen refused:", e)
        libc = ctypes.CDLL(None, use_errno=True)
        print("ptrace:", libc.syscall(101, 16, 1, 0, 0), ctypes.get_errno())  # PTRACE_ATTACH pid 1
        print("unshare:", libc.syscall(272, 0x10000000), ctypes.get_errno())  # CLONE_NEWUSER
        """
    )
    assert "LOADED" not in text and "dlopen refused" in text, text
    assert "ptrace: -1 1" in text and "unshare: -1 1" in text, text  # EPERM from the filter


@pytest.fixture(params=["cgroup", "no cgroup"])
def cgroup_mode(request, monkeypatch):
    """Issue 53's attacks run both ways: with the run's cgroup (root here) and without one (what a non-root
    trainer without a delegated subtree gets: cgroups.create returns None)."""
    if request.param == "no cgroup":
        monkeypatch.setattr(cgroups, "create", lambda *a, **k: None)
    return request.param


def test_pid_1_and_the_code_s_own_memory_cannot_be_written_through_proc(cgroup_mode):
    """Issue 53: bwrap's init (pid 1) had the code's uid and was dumpable, so the code opened /proc/1/mem
    read-write and wrote machine code at its wait4 return: a process outside the inner filter and the
    rlimits, outliving the call without a cgroup. Now there is no /proc inside (no /proc/<pid>/mem to open),
    and pid 1 is the bootstrap itself (--as-pid-1), made non-dumpable before it forks the code, with the
    code's filters and limits. Seen from the host: both processes' /proc files belong to root (not
    dumpable), both carry the outer and the inner filter and the same CPU limit. Inside: PR_SET_DUMPABLE
    cannot be turned back on (EPERM)."""
    code = """
        import ctypes, os, resource, time
        libc = ctypes.CDLL(None, use_errno=True)
        print("pid", os.getpid())
        for path in ("/proc/1/mem", "/proc/self/mem"):
            try:
                os.open(path, os.O_RDWR)
                print(path, "OPENED")
            except OSError as e:
                print(path, e.errno)
        print("dumpable", libc.prctl(3, 0, 0, 0, 0))  # PR_GET_DUMPABLE
        print("dumpable on", libc.prctl(4, 1, 0, 0, 0), ctypes.get_errno())
        print("dumpable", libc.prctl(3, 0, 0, 0, 0))
        cpu = resource.RLIMIT_CPU
        print("same cpu limit", resource.prlimit(1, cpu) == resource.getrlimit(cpu) != (-1, -1))
        time.sleep(1.5)
        """
    done: list = []
    thread = threading.Thread(target=lambda: done.append(run(code)))
    thread.start()
    seen: dict = {}
    try:
        while thread.is_alive() and not (len(seen) == 2 and all(v[0] == "2" for v in seen.values())):
            seen = {}
            for pid in sandbox_processes(programs_only=True):
                try:
                    status = Path(f"/proc/{pid}/status").read_text()
                    cpu = [
                        line for line in Path(f"/proc/{pid}/limits").read_text().splitlines() if "cpu" in line
                    ]
                    owner = os.stat(f"/proc/{pid}/mem").st_uid
                except OSError:
                    continue
                filters = status.split("Seccomp_filters:")[1].split()[0]
                seen[pid] = (filters, owner, uids_of(pid), cpu[0])
            time.sleep(0.02)
    finally:
        thread.join()
    assert len(seen) == 2, seen  # pid 1 (the bootstrap) and the code, both the interpreter
    for filters, owner, uids, cpu in seen.values():
        assert filters == "2" and owner == 0 and "0" not in uids, seen  # not dumpable; not root either
        assert "unlimited" not in cpu, seen
    assert len({v[3] for v in seen.values()}) == 1, seen  # the same CPU limit
    ((text, result),) = done
    lines = text.splitlines()
    assert "pid 2" in lines, text  # the code is pid 2, its parent the bootstrap
    assert "/proc/1/mem 2" in lines and "/proc/self/mem 2" in lines, text  # ENOENT: no /proc
    assert lines.count("dumpable 0") == 2 and "dumpable on -1 1" in lines, text  # EPERM from the inner filter
    assert "same cpu limit True" in lines, text
    assert result.returncode == 0, text


def test_everything_writable_together_is_bounded_by_disk_mb(cgroup_mode):
    """Issue 53: / and /dev were tmpfs of no size, so without a cgroup one call wrote 1200 MB of host RAM
    against memory_mb 256 + disk_mb 64. Now / , /dev and the hiding tmpfs are read-only (EROFS, also after
    a chmod by their owner) and the two writable mounts, /sandbox and /dev/shm, are sized: together they
    take disk_mb and no more (ENOSPC), with or without a cgroup."""
    text, result = run(
        """
        import os
        chunk = b"x" * (256 << 10)
        total = 0
        for folder in ("/sandbox", "/dev/shm", "/", "/dev", "/usr/lib", "/proc"):
            try:
                os.chmod(folder, 0o777)
            except OSError:
                pass
            i, why = 0, None
            while why is None and total < 64 << 20:
                try:
                    with open(f"{folder.rstrip('/')}/fill{i}", "wb") as f:
                        f.write(chunk)
                    total += len(chunk)
                    i += 1
                except OSError as e:
                    why = e.errno
            print(folder, i, why)
        print("total MiB", total / (1 << 20))
        """,
        disk_mb=8,
        file_size_mb=1,
    )
    lines = text.splitlines()
    written = dict((line.split()[0], line.split()[1:]) for line in lines if line.startswith("/"))
    assert written["/sandbox"][1] == "28" and written["/dev/shm"][1] == "28", text  # ENOSPC
    for folder in ("/", "/dev", "/usr/lib"):
        assert written[folder] == ["0", "30"], text  # EROFS
    assert written["/proc"][0] == "0", text
    assert float(lines[-1].split()[-1]) <= 8, text
    assert int(written["/sandbox"][0]) >= 20, text  # most of it is the working directory's


def test_no_proc_and_a_dev_of_five_devices():
    """Issue 53: /proc told the host's block device and bind sources (/proc/self/mountinfo), the kernel's
    version and command line; /dev/pts let the code take ptys from a host-wide count. There is no /proc and
    /dev holds null, zero, full, random, urandom and the sized shm only: no pts, ptmx or tty."""
    text, result = run(
        """
        import os
        for path in ("/proc/self/mountinfo", "/proc/version", "/proc/sys/kernel/osrelease", "/proc/cmdline"):
            try:
                print(path, open(path).read()[:60])
            except OSError as e:
                print(path, "errno", e.errno)
        print("dev", sorted(os.listdir("/dev")))
        try:
            os.openpty()
            print("PTY")
        except OSError as e:
            print("openpty errno", e.errno)
        """
    )
    lines = text.splitlines()
    for path in ("/proc/self/mountinfo", "/proc/version", "/proc/sys/kernel/osrelease", "/proc/cmdline"):
        assert f"{path} errno 2" in lines, text
    assert "dev ['full', 'null', 'random', 'shm', 'urandom', 'zero']" in lines, text
    assert "openpty errno 2" in lines, text
    assert "/dev/" not in text.replace("dev [", ""), text  # no host device name anywhere


def test_a_process_that_leaves_the_session_does_not_outlive_the_call(cgroup_mode):
    """Issue 53, point 4: without a cgroup, nothing may outlive its call. A grandchild in a session of its
    own (setsid, allowed as in Docker's profile: the supervisor's process-group kill misses it) that keeps
    running after the code's process ends is killed with the pid namespace when its pid 1 exits."""
    text, result = run(
        """
        import os, time
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                time.sleep(30)
            os._exit(0)
        time.sleep(0.3)
        print("left", os.getpid())
        """
    )
    assert "left 2" in text and result.returncode == 0, text
    deadline = time.monotonic() + 3
    while sandbox_processes() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sandbox_processes() == []


def test_processes_are_bounded_with_or_without_a_cgroup(cgroup_mode):
    """Issue 53, point 4: without a cgroup, RLIMIT_NPROC (counted in the run's own user namespace, so per
    call) bounds the processes as the cgroup's pids.max does: a fork loop gets no more than max_processes."""
    text, result = run(
        """
        import os, time
        made = 0
        try:
            while made < 100:
                if os.fork() == 0:
                    time.sleep(5)
                    os._exit(0)
                made += 1
        except OSError as e:
            print("refused", e.errno)
        print("made", made)
        """,
        max_processes=6,
    )
    made = int(text.split("made ")[1].split()[0])
    assert "refused 11" in text and 1 <= made <= 6, text  # EAGAIN


def test_only_unix_and_ip_sockets_exist_and_no_executable_shared_memory():
    """Issue 53: AF_VSOCK is not namespaced (sandbox and host share its ports; on a VM it reaches the
    hypervisor), AF_NETLINK and AF_PACKET are kernel surfaces: socket() and socketpair() of any family but
    AF_UNIX, AF_INET and AF_INET6 fail with EAFNOSUPPORT, whatever the register's upper bits. shmat with
    SHM_EXEC (an RWX page: new native code), memfd_create and modify_ldt fail with EPERM; so does all of
    System V IPC (a new ipc namespace has no size limit: shmget of 1 GiB and more worked, outside every
    limit without a cgroup), and the calls Docker's default profile refuses (NUMA placement, madvise of
    another process)."""
    text, result = run(
        """
        import ctypes, socket
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        def call(*args):
            ctypes.set_errno(0)
            return libc.syscall(*args), ctypes.get_errno()
        for family in (socket.AF_UNIX, socket.AF_INET, socket.AF_INET6, 40, 16, 17, 0, 3, 9, 11, 255):
            try:
                socket.socket(family, socket.SOCK_DGRAM).close()
                print("socket", family, "made")
            except OSError as e:
                print("socket", family, "errno", e.errno)
        print("vsock upper bits", call(41, ctypes.c_uint64((1 << 32) | 40), 2, 0))
        pair = (ctypes.c_int * 2)()
        print("socketpair vsock", call(53, 40, 1, 0, pair), "unix", call(53, 1, 1, 0, pair)[0])
        print("memfd_create", call(319, b"x", 0))
        print("modify_ldt", call(154, 0, 0, 0))
        print("shmget", call(29, 0, 1 << 30, 0o1600))  # shmget(IPC_PRIVATE, 1 GiB, IPC_CREAT | 0600)
        print("shmat exec", call(30, 0, 0, 0o100000))  # SHM_EXEC
        print("msgget", call(68, 0, 0o1600), "semget", call(64, 0, 1, 0o1600))
        print("mbind", call(237, 0, 4096, 0, 0, 0, 0), "process_madvise", call(440, 0, 0, 0, 0, 0))
        """
    )
    lines = text.splitlines()
    for family in (1, 2, 10):
        assert f"socket {family} made" in lines, text
    for family in (40, 16, 17, 0, 3, 9, 11, 255):  # VSOCK NETLINK PACKET UNSPEC AX25 ... RDS ...
        assert f"socket {family} errno 97" in lines, text  # EAFNOSUPPORT
    assert "vsock upper bits (-1, 97)" in lines, text
    assert "socketpair vsock (-1, 97) unix 0" in lines, text
    assert "memfd_create (-1, 1)" in lines and "modify_ldt (-1, 1)" in lines, text
    assert "shmget (-1, 1)" in lines and "shmat exec (-1, 1)" in lines, text
    assert "msgget (-1, 1) semget (-1, 1)" in lines, text
    assert "mbind (-1, 1) process_madvise (-1, 1)" in lines, text


def test_terminal_escapes_in_output_are_shown_not_run():
    """Issue 53: OSC 0 (window title), OSC 52 (clipboard), OSC 8 (hidden link), CSI (clear screen), C1 and a
    carriage return printed by the code reached observations, transcripts and terminals as they were. The
    observation, through the ToolRunner, holds them as visible escapes; newlines, tabs and other scripts
    stay as they are."""
    code = (
        "import sys\n"
        "print('\\x1b]0;owned\\x07 \\x1b]52;c;ZWNobyBwd25lZA==\\x07 \\x1b]8;;http://evil\\x1b\\\\link')\n"
        "print('\\x1b[2J\\rover \\x9b31m \\x00 \\u202eevil\\tok Ω 🙂')\n"
        "sys.stderr.write('\\x1b]52;c;Zm9v\\x07\\n')\n"
    )
    runner = ToolRunner([make_python_tool(audit_guard=False)])
    call = json.dumps({"name": "python", "arguments": {"code": code}})
    (result,) = runner.run(f"<tool_call>{call}</tool_call>")
    text = result.content[0]["text"]
    assert not any(ord(c) < 32 and c not in "\n\t" or 0x7F <= ord(c) < 0xA0 for c in text), repr(text)
    assert "\u202e" not in text, repr(text)
    assert "\\x1b]0;owned\\x07" in text and "\\x1b]52;c;ZWNobyBwd25lZA==\\x07" in text, text
    assert "\\x1b]8;;http://evil\\x1b\\link" in text and "\\x1b[2J\\x0dover \\x9b31m \\x00" in text, text
    assert "\\u202eevil\tok Ω 🙂" in text and "stderr:\n\\x1b]52;c;Zm9v\\x07" in text, text


def test_terminal_escapes_from_any_tool_are_shown_not_run():
    """Issue 53, point 5: the same for every tool through the ToolRunner (an HTTP tool's page, an env's
    function): its text, the error of a tool that raised and the echoed name of an unknown tool hold their
    control characters as escapes, and the result's limit counts the escapes (what is shown)."""

    def page(url: str) -> str:
        """A page.

        Args:
            url: where.
        """
        return "\x1b]52;c;ZWNobw==\x07 \x1b[2J" + "\x00" * 100

    def broken(url: str) -> str:
        """Fails.

        Args:
            url: where.
        """
        raise ValueError("\x1b]0;owned\x07")

    runner = ToolRunner([page, broken], max_result_chars=50)
    calls = [json.dumps({"name": n, "arguments": {"url": "x"}}) for n in ("page", "broken", "\x1b[31mred")]
    results = runner.run("".join(f"<tool_call>{c}</tool_call>" for c in calls))
    texts = [r.content[0]["text"] for r in results] + [results[2].name]
    for text in texts:
        assert not any(ord(c) < 32 and c not in "\n\t" or 0x7F <= ord(c) < 0xA0 for c in text), repr(text)
    assert texts[0].startswith("\\x1b]52;c;ZWNobw==\\x07 \\x1b[2J\\x00"), texts[0]
    shown = (
        len(visible(page("x")[:50])) + len(page("x")) - 50
    )  # escapes on what can be kept, the rest as it was
    assert results[0].failure == "oversized" and f"result was {shown} characters, limit 50]" in texts[0], (
        texts[0]
    )
    assert "\\x1b]0;owned\\x07" in texts[1] and results[1].failure == "tool_error", texts[1]
    assert results[2].failure == "unknown_tool" and texts[3] == "\\x1b[31mred", texts[2:]


# ------------------------------------------------------------------------------------ root-owned files
def test_nothing_is_root_inside_and_read_only_files_stay_read_only():
    text, result = run(
        """
        import os
        import ctypes
        class Header(ctypes.Structure):
            _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]
        class Data(ctypes.Structure):
            _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]
        data = (Data * 2)()
        rc = ctypes.CDLL(None).capget(ctypes.byref(Header(0x20080522, 0)), data)  # _LINUX_CAPABILITY_VERSION_3
        print("capget", rc, "effective", [d.effective for d in data], "permitted", [d.permitted for d in data])
        open("ro.txt", "w").write("x")
        os.chmod("ro.txt", 0o444)
        for path in ("ro.txt", "/usr/bin/true"):
            try:
                open(path, "a").write("y")
                print("WROTE", path)
            except OSError as e:
                print("refused", path, type(e).__name__)
        """
    )
    assert "capget 0 effective [0, 0] permitted [0, 0]" in text, text
    assert "WROTE" not in text and "refused ro.txt PermissionError" in text, text


def test_the_sandbox_runs_as_an_unprivileged_uid_on_the_host():
    started = time.monotonic()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from mmgrpo.toolbox.sandbox import run_python; run_python('import time; time.sleep(3)')",
        ]
    )
    try:
        uids: list = []
        while time.monotonic() - started < 10 and not uids:
            uids = [u for p in sandbox_processes(programs_only=True) if (u := uids_of(p))]
            time.sleep(0.05)
        assert uids, "the sandboxed program was never seen"
        assert all("0" not in u for u in uids), uids
    finally:
        proc.wait(timeout=20)


# ------------------------------------------------------------------------------------ other processes
def test_the_trainer_and_host_processes_cannot_be_signalled():
    bystander = subprocess.Popen(["sleep", "30"])
    try:
        text, result = run(
            f"""
            import os, signal
            for pid in ({os.getpid()}, {bystander.pid}, 1):
                try:
                    os.kill(pid, 0)
                    print("SEES", pid)
                except OSError as e:
                    print("kill", pid, type(e).__name__)
                try:
                    fd = os.pidfd_open(pid)
                    signal.pidfd_send_signal(fd, signal.SIGKILL)
                    print("PIDFD", pid)
                except OSError as e:
                    print("pidfd", pid, type(e).__name__)
            os.kill(-1, signal.SIGKILL)  # everything it may signal: only the sandbox's own processes
            """
        )
        assert "PIDFD" not in text and "SEES " + str(os.getpid()) not in text, text
        assert "pidfd" in text and "PermissionError" in text, text
        assert bystander.poll() is None  # still running, and so is this process
    finally:
        bystander.kill()
        bystander.wait()


# ------------------------------------------------------------------------------------- the filesystem
def test_a_chdir_race_reaches_nothing_outside(tmp_path):
    """The old path check could be raced (a thread's chdir against another's relative open). With nothing of
    the host mounted, there is nothing to race to."""
    secret = tmp_path / "secret.txt"
    secret.write_text("s3cret")
    rel = str(secret).lstrip("/")
    text, _ = run(
        f"""
        import os, threading
        stop, hits = False, []
        def hop():
            while not stop:
                for d in ("/", "/sandbox"):
                    os.chdir(d)
        t = threading.Thread(target=hop)
        t.start()
        for _ in range(3000):
            for path in ({rel!r}, "etc/passwd", "proc/1/environ"):
                try:
                    hits.append(open(path).read()[:20])
                except OSError:
                    pass
        stop = True
        t.join()
        print("hits:", hits[:3])
        """,
        wall_seconds=20,
        cpu_seconds=20,
    )
    assert "s3cret" not in text and "root:" not in text, text


def test_a_tree_deeper_than_the_recursion_limit_is_cleaned_up_by_the_kernel():
    before = set(os.listdir(tempfile.gettempdir()))
    text, result = run(
        """
        import os
        for i in range(3000):
            os.mkdir("d")
            os.chdir("d")
        os.chmod(".", 0)
        print("deep")
        """
    )
    assert "deep" in text and result.killed_reason is None
    assert set(os.listdir(tempfile.gettempdir())) - before == set()
    assert run_python("print('next')").stdout == "next\n"


def test_dev_shm_does_not_outlive_the_call():
    host_before = set(os.listdir("/dev/shm"))
    run("open('/dev/shm/mmgrpo-left', 'w').write('x'); print('written')")
    text, _ = run("import os; print(sorted(os.listdir('/dev/shm')))")
    assert text.strip() == "[]"
    assert set(os.listdir("/dev/shm")) - host_before == set()


# ---------------------------------------------------------------------------------------- supervision
def test_garbage_on_every_descriptor_and_forged_exit_codes_are_only_data():
    text, result = run(
        """
        import os
        for fd in range(3, 256):
            try:
                os.write(fd, b"\\x00\\xff garbage 999\\n" * 100)
            except OSError:
                pass
        print("done")
        """
    )
    assert "done" in text and result.returncode == 0
    for status in (97, 101, 137):  # the codes that mean setup failure, memory, SIGKILL
        _, result = run(f"import os; os._exit({status})")
        assert result.returncode is not None  # reported, never raised


def test_a_trainer_killed_mid_call_takes_every_sandbox_process_with_it():
    script = (
        "from mmgrpo.toolbox.sandbox import run_python; import sys; print('go', flush=True); "
        "run_python('import os, time\\nfor _ in range(3): os.fork()\\ntime.sleep(60)', wall_seconds=60, "
        "cpu_seconds=60, audit_guard=False)"
    )
    trainer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
    assert trainer.stdout.readline().strip() == b"go"
    deadline = time.monotonic() + 10
    while len(sandbox_processes()) < 8 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(sandbox_processes()) >= 8  # the program and its 7 children
    trainer.send_signal(signal.SIGKILL)
    trainer.wait()
    deadline = time.monotonic() + 5
    while sandbox_processes() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sandbox_processes() == []
    group = cgroups.create(1 << 20, 4)  # the next run removes the killed trainer's empty group
    if group is not None:
        group.close()
        for path in group.paths:
            assert not any(
                p.name.startswith(f"{cgroups.PREFIX}{trainer.pid}-") for p in path.parent.iterdir()
            )


def test_the_runner_waits_for_the_python_tool_s_own_time_limit():
    """The old runner cut a correct 4.8 s program under a 5 s wall limit with its own 5 s deadline. The
    runner's deadline follows the tool's own (``timeout_s`` = wall_seconds + 5): here a runner deadline of
    0.3 s and a 0.8 s program under a 1 s wall limit, and the model gets the program's output."""
    runner = ToolRunner([make_python_tool(wall_seconds=1)], timeout_s=0.3)
    call = '<tool_call>{"name": "python", "arguments": {"code": "import time\\ntime.sleep(0.8)\\nprint(42)"}}</tool_call>'
    (result,) = runner.run(call)
    assert result.failure is None and result.content[0]["text"].strip() == "42", result


# ---------------------------------------------------------------------------------------------- memory
def test_memory_is_bounded_for_the_whole_process_tree():
    """With a cgroup (root, as in CI): four processes of 150 MB under memory_mb 256 are killed by the group.
    Without one the documented fallback holds instead: each process alone is bounded by memory_mb."""
    text, result = run(
        """
        import os
        kids = []
        for i in range(4):
            pid = os.fork()
            if pid == 0:
                try:
                    block = bytearray((150 if i < 3 else 300) << 20)  # the last alone is over 256 MB
                    for j in range(0, len(block), 4096):
                        block[j] = 1
                except MemoryError:
                    os._exit(3)
                import time; time.sleep(2)
                os._exit(0)
            kids.append(pid)
        print([os.waitstatus_to_exitcode(os.waitpid(k, 0)[1]) for k in kids])
        """,
        memory_mb=256,
        disk_mb=16,
    )
    if result.isolation == "bwrap+cgroup":
        assert result.killed_reason == "memory limit", text
        assert "-9" in text  # some of the children were killed by the group's limit
    else:
        assert result.isolation == "bwrap", result
        assert ", 3]" in text, text  # the 300 MB process alone hit its own limit


# ------------------------------------------------------------------- every attack through the tool runner
ATTACKS = {
    "escape": "open('/etc/passwd').read()",
    "native": "import ctypes; ctypes.CDLL('libz.so.1')",
    "signal": f"import os; os.kill({os.getpid()}, 9)",
    "deep": "import os\nfor _ in range(3000):\n    os.mkdir('d'); os.chdir('d')",
    "fork": "import os\nwhile True:\n    os.fork()",
    "garbage": "import os\nfor fd in range(3, 64):\n    try: os.write(fd, b'x')\n    except OSError: pass",
}


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_each_attack_is_an_observation_through_the_tool_runner(name):
    runner = ToolRunner([make_python_tool(wall_seconds=3, audit_guard=False)])
    call = json.dumps({"name": "python", "arguments": {"code": ATTACKS[name]}})
    (result,) = runner.run(f"<tool_call>{call}</tool_call>")
    assert result.failure is None  # the tool returned; what happened is in the text the model reads
    assert isinstance(result.content[0]["text"], str) and result.content[0]["text"]


# ------------------------------------------------------------------------------ without the sandbox tool
@pytest.fixture
def no_bwrap(monkeypatch):
    bwrap.boundary.cache_clear()
    monkeypatch.setattr(bwrap.shutil, "which", lambda name, path=None: None)
    yield
    bwrap.boundary.cache_clear()


def test_without_bubblewrap_the_python_tool_refuses_to_start(no_bwrap):
    with pytest.raises(
        ConfigError, match=r"bubblewrap \(bwrap\) is not installed: apt-get install bubblewrap"
    ):
        make_python_tool()
    for code in ATTACKS.values():  # and the engine itself starts nothing
        result = run_python(code, audit_guard=False)
        assert result.killed_reason == "not started" and "apt-get install bubblewrap" in result.stderr


def test_the_weak_sandbox_must_be_accepted_and_says_so_loudly(no_bwrap, capsys):
    with pytest.warns(RuntimeWarning, match="WITHOUT its OS sandbox"):
        tool = make_python_tool(weak_sandbox=True, name="python_weak_test")
    assert "WITHOUT its OS sandbox" in capsys.readouterr().err
    assert tool("print(6 * 7)").strip() == "42"
