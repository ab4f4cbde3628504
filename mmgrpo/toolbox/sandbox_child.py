"""What runs inside the ``python`` tool's child process; :mod:`mmgrpo.toolbox.sandbox` (the parent side)
starts it as ``python -I -S -B -u -X utf8 -c BOOTSTRAP ...`` and reads what it printed.

:data:`BOOTSTRAP`, the child's program, imports the modules the code names (their C extensions must be
mapped before the next step), loads the inner seccomp filter (no ``execve``, no new executable mappings;
bubblewrap runs only), sets the resource limits on itself (``RLIMIT_CPU``, ``RLIMIT_AS``,
``RLIMIT_FSIZE``, ``RLIMIT_NOFILE``, ``RLIMIT_CORE`` 0 and, in a user namespace, ``RLIMIT_NPROC``), installs
a Python audit hook (``sys.addaudithook``, the guard) and runs the code as ``__main__``. The guard refuses
sockets, new processes, ``ctypes``, writes outside the working directory and reads outside it and the
standard library with a ``PermissionError`` that the code (and so the model) sees. It is a guard against
ordinary code, not a security boundary against code written to get around it. In a new pid namespace the
bootstrap stays as the namespace's init and reports the code's wait status to the parent. Under bubblewrap
(``--as-pid-1``, status_fd -2) it is the namespace's init itself: it sets the limits, makes itself
non-dumpable, forks the code's process and loads the inner filter on itself (the child loads it after its
imports, and waits for pid 1 before the code starts), so that pid 1 has the same limits and filters as the
code and its ``/proc/1/mem`` cannot be opened for writing by anything inside.

The limits are set by the child itself (the first lines of the bootstrap) rather than in a ``preexec_fn``:
``preexec_fn`` is not safe when the parent has threads, and the tool runner calls tools from threads.
"""

from __future__ import annotations

EXIT_MEMORY = 101
"""Exit status the bootstrap uses when the code ran out of memory (a MemoryError nobody caught)."""
EXIT_SETUP = 97
"""Exit status when the sandbox could not be set up (a namespace mount, or the inner seccomp filter)."""

# --------------------------------------------------------------------------------------------- the child
# Run as ``python -I -S -B -u -X utf8 -c BOOTSTRAP workdir source cpu as fsize nproc nofile guard status_fd
# preload(comma-separated modules) [inner_filter_hex]``
# in workdir.
# It sets the limits, reads main.py, installs the guard and runs the code as __main__. The guard is built
# by exec'ing _GUARD in a namespace with no builtins: everything it uses is a parameter of install(), so that
# the hook reads only closure cells, which the code cannot reach or rebind (monkeypatching os, builtins or
# posixpath changes nothing the hook uses).
_GUARD = r'''
def install(sys, workdir, read_roots, deny_imports, lstat, readlink, getcwd, getpid,
            PermissionError, ImportError, OSError, type, str, bytes, int, list):
    O_WRITE = 0o1 | 0o2 | 0o100 | 0o1000 | 0o2000  # O_WRONLY O_RDWR O_CREAT O_TRUNC O_APPEND (Linux)

    def resolve(path):
        """The absolute path with every symlink followed (like os.path.realpath, from captured primitives)."""
        if type(path) is bytes:
            path = path.decode("utf-8", "surrogateescape")
        if type(path) is not str:
            raise PermissionError("sandbox: unexpected path argument")
        if not path.startswith("/"):
            path = getcwd() + "/" + path
        todo = path.split("/")
        todo.reverse()
        parts = list()
        hops = 0
        is_dir = True  # "/"
        while todo:
            name = todo.pop()
            if name == "" or name == ".":
                continue
            if name == "..":
                if parts:
                    parts.pop()
                is_dir = True
                continue
            here = "/" + "/".join(parts) + ("/" if parts else "") + name
            try:
                mode = lstat(here).st_mode
            except OSError:  # does not exist (yet)
                parts.append(name)
                is_dir = False
                continue
            if mode & 0o170000 == 0o120000:  # a symlink
                hops += 1
                if hops > 40:
                    raise PermissionError("sandbox: too many symbolic links")
                target = readlink(here)
                if target.startswith("/"):
                    parts = list()
                    is_dir = True
                more = target.split("/")
                more.reverse()
                todo.extend(more)
            else:
                parts.append(name)
                is_dir = mode & 0o170000 == 0o040000
        return "/" + "/".join(parts), is_dir

    def no_dotdot(path):
        """Refuse a relative path with '..' where it may be relative to a directory fd, not the cwd."""
        if type(path) is bytes:
            path = path.decode("utf-8", "surrogateescape")
        if type(path) is str and not path.startswith("/") and ".." in path.split("/"):
            raise PermissionError(f"sandbox: '..' in a path relative to a directory fd is not allowed ({path})")

    def inside(path, roots):
        for root in roots:
            if path == root or path.startswith(root + "/"):
                return True
        return False

    def check_write(path, what):
        if type(path) is int:
            return
        real, _ = resolve(path)
        if not inside(real, (workdir,)):
            raise PermissionError(f"sandbox: {what} outside the working directory is not allowed ({real})")

    def check_read(path):
        if type(path) is int:
            return
        real, _ = resolve(path)
        if not inside(real, read_roots):
            raise PermissionError(
                f"sandbox: reading {real} is not allowed (only files in the working directory)"
            )

    def hook(event, args):
        if event == "open":
            path, mode, flags = args
            if type(path) is int:
                return
            if mode is None:  # os.open: the event does not say whether dir_fd= was given
                no_dotdot(path)
            if (type(flags) is int and flags & O_WRITE) or (type(mode) is str and mode.strip("rbtU") != ""):
                check_write(path, "writing")
                return
            real, is_dir = resolve(path)
            if not inside(real, read_roots):
                raise PermissionError(
                    f"sandbox: reading {real} is not allowed (only files in the working directory)"
                )
            if mode is None and is_dir and not inside(real, (workdir,)):
                # a directory fd outside the working directory would let dir_fd= escape the path checks
                raise PermissionError(f"sandbox: os.open of the directory {real} is not allowed")
            return
        if event == "import":
            if type(args[0]) is not str or args[0] in deny_imports:
                raise ImportError(f"sandbox: the module {args[0]} is not available")
            return
        if event in ("os.listdir", "os.scandir"):
            if args[0] is not None:
                check_read(args[0])
            return
        if event in ("os.mkdir", "os.rmdir", "os.remove", "os.chmod", "os.chown", "os.utime"):
            if type(args[-1]) is int and args[-1] != -1:  # dir_fd=
                no_dotdot(args[0])
            check_write(args[0], "changing files")
            return
        if event in ("os.truncate", "os.setxattr", "os.removexattr", "shutil.rmtree"):
            check_write(args[0], "changing files")
            return
        if event == "os.rename":  # also os.replace
            if (type(args[2]) is int and args[2] != -1) or (type(args[3]) is int and args[3] != -1):
                no_dotdot(args[0])
                no_dotdot(args[1])
            check_write(args[0], "changing files")
            check_write(args[1], "changing files")
            return
        if event == "shutil.copyfile" or event == "shutil.move":
            check_read(args[0])
            check_write(args[1], "writing")
            return
        if event in ("os.link", "os.symlink"):
            raise PermissionError("sandbox: creating links is not allowed")
        if event == "sqlite3.connect":
            database = args[0]
            if not (type(database) is str and (database == ":memory:" or database == "")):
                check_write(database, "writing")
            return
        if event.startswith("socket."):
            raise PermissionError(f"sandbox: network access is not allowed ({event})")
        if event in ("os.system", "os.exec", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn",
                     "subprocess.Popen", "os.startfile", "pty.spawn"):
            raise PermissionError(f"sandbox: starting new processes is not allowed ({event})")
        if event in ("os.kill", "os.killpg"):
            if event == "os.kill" and args[0] == getpid():
                return
            raise PermissionError(f"sandbox: sending signals to other processes is not allowed ({event})")
        if event.startswith("ctypes."):
            raise PermissionError(f"sandbox: ctypes is not allowed ({event})")
        if event in ("resource.setrlimit", "resource.prlimit", "sys.settrace", "sys.setprofile",
                     "gc.get_objects", "gc.get_referrers", "gc.get_referents",
                     "cpython.PyInterpreterState_New"):
            raise PermissionError(f"sandbox: {event} is not allowed")

    sys.addaudithook(hook)
'''

BOOTSTRAP = r"""
def _harden(sys, os, inner_filter):
    '''Make this process non-dumpable and return the function that loads the inner filter. Not dumpable: the process's /proc files (mem above all) belong to the host's root, which
    is no one inside, so neither the code nor another process of the sandbox can open them for writing;
    fork keeps it, execve is refused, and the inner filter refuses PR_SET_DUMPABLE.'''
    import ctypes

    class Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    libc = ctypes.CDLL(None, use_errno=True)
    code_buf = ctypes.create_string_buffer(inner_filter, len(inner_filter))
    prog = Program(len(inner_filter) // 8, ctypes.cast(code_buf, ctypes.c_void_p))
    libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS (bubblewrap set it already)
    if libc.prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE
        sys.stderr.write("sandbox: the process could not be made non-dumpable\n")
        os._exit(EXIT_SETUP)

    def seal():  # no execve, no PROT_EXEC mappings from here on (mmgrpo.toolbox.seccomp.inner_filter)
        if libc.prctl(22, 2, ctypes.byref(prog), 0, 0) != 0:  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
            sys.stderr.write("sandbox: the inner seccomp filter could not be loaded\n")
            os._exit(EXIT_SETUP)

    return seal


def _main():
    import sys, os, io, resource, builtins, posix
    workdir, source_path = sys.argv[1:3]
    cpu, mem, fsize, nproc, nofile, guard, status_fd = (int(x) for x in sys.argv[3:10])
    preload = [m for m in sys.argv[10].split(",") if m]
    inner_filter = bytes.fromhex(sys.argv[11]) if len(sys.argv) > 11 else b""
    if status_fd >= 0:  # pid 1 of unshare's pid namespace: stay as its init, run the code in a child
        child = os.fork()
        if child:
            os.close(0)
            while True:  # reap everything; stop when the code's process ends
                try:
                    pid, status = os.waitpid(-1, 0)
                except ChildProcessError:
                    os._exit(1)
                if pid == child:
                    os.write(status_fd, b"%d\n" % status)
                    os._exit(0)  # init exits: the kernel kills whatever is left in the namespace
        os.close(status_fd)
    with open(source_path, encoding="utf-8") as f:
        source = f.read()
    with open("main.py", "w", encoding="utf-8") as f:  # in the working directory, for tracebacks
        f.write(source)
    R = resource

    def limit(what, value):
        if value < 0:
            return
        soft, hard = R.getrlimit(what)
        if hard != R.RLIM_INFINITY:
            value = min(value, hard)
        R.setrlimit(what, (value, value))

    limit(R.RLIMIT_CPU, cpu)  # soft == hard: SIGKILL at the limit, the code cannot catch it
    limit(R.RLIMIT_AS, mem)
    limit(R.RLIMIT_FSIZE, fsize)
    limit(R.RLIMIT_NOFILE, nofile)
    limit(R.RLIMIT_CORE, 0)
    limit(R.RLIMIT_NPROC, nproc)
    seal = _harden(sys, os, inner_filter) if inner_filter else None  # not dumpable from here on
    sealed_r = sealed_w = -1
    if status_fd == -2:  # pid 1 under bwrap --as-pid-1: stay as init, run the code in a child
        sealed_r, sealed_w = os.pipe()
        child = os.fork()
        if child:
            os.close(sealed_r)
            os.close(0)
            if seal is not None:
                seal()  # pid 1 has the code's inner filter too
            os.close(sealed_w)  # the code may start now
            while True:  # reap everything; when the code's process ends, exit as it did (bwrap passes it on)
                try:
                    pid, status = os.waitpid(-1, 0)
                except ChildProcessError:
                    os._exit(1)
                if pid == child:  # init exits: the kernel kills whatever is left in the namespace
                    os._exit(128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status))
        os.close(sealed_w)
    if guard:  # the guard replaces its fork_exec below; a C extension in some builds (pyenv's), so now
        import _posixsubprocess
    if preload:  # the modules the code imports, now: once the inner filter is on, no native code can be mapped
        import importlib
        for name in preload:
            try:
                importlib.import_module(name)
            except BaseException:
                pass
    if seal is not None:
        seal()
        del seal
    if sealed_r >= 0:  # wait until pid 1 is sealed too (its end of the pipe closed)
        os.read(sealed_r, 1)
        os.close(sealed_r)
    sys.argv = ["main.py"]
    sys.stdin = io.StringIO()
    if guard:
        import _posixsubprocess

        def fork_exec(*args, **kwargs):
            raise PermissionError("sandbox: starting new processes is not allowed (fork_exec)")

        _posixsubprocess.fork_exec = fork_exec  # the C function has no audit event of its own
        for name in ("mkfifo", "mknod"):  # file creation without an audit event
            for module in (os, posix):
                if hasattr(module, name):
                    delattr(module, name)
        roots = tuple(os.path.realpath(p) for p in sys.path if p) + (workdir,)
        deny = frozenset((
            "_ctypes", "ctypes", "_ctypes_test", "_posixsubprocess", "_posixshmem", "_xxsubinterpreters",
            "_xxinterpchannels", "_interpreters", "_interpchannels", "_interpqueues", "_testcapi",
            "_testinternalcapi", "_testbuffer", "_testmultiphase", "_testsinglephase", "_testclinic",
            "_testimportmultiple", "_xxtestfuzz", "_dbm", "_gdbm", "dbm", "syslog", "spwd", "nis",
        ))
        space = {"__builtins__": {}}
        exec(compile(_GUARD, "<sandbox>", "exec"), space)
        space.pop("install")(
            sys, workdir, roots, deny, posix.lstat, posix.readlink, posix.getcwd, posix.getpid,
            PermissionError, ImportError, OSError, type, str, bytes, int, list,
        )
        del space
        for name in [m for m in sys.modules if m.split(".")[0] in deny - {"_posixsubprocess"}]:
            del sys.modules[name]  # loaded by the bootstrap: an import of them goes through the guard again
    main = type(sys)("__main__")
    main.__file__ = "main.py"
    main.__builtins__ = builtins
    sys.modules["__main__"] = main
    try:
        code = compile(source, "main.py", "exec")
        del source
        exec(code, main.__dict__)
    except SystemExit:
        raise
    except MemoryError:
        sys.stderr.write("MemoryError: the memory limit was reached\n")
        sys.stdout.flush()
        os._exit(EXIT_MEMORY)
    except BaseException as e:
        import traceback
        # the traceback as the code would see it: without this bootstrap frame and the guard's frames
        tb = e.__traceback__.tb_next if e.__traceback__ is not None else None
        report = traceback.TracebackException(type(e), e, tb)
        todo, seen = [report], set()
        while todo:
            item = todo.pop()
            if item is None or id(item) in seen:
                continue
            seen.add(id(item))
            frames = [f for f in item.stack if f.filename != "<sandbox>"]
            item.stack = traceback.StackSummary.from_list(frames)
            todo += [item.__cause__, item.__context__]
        sys.stderr.write("".join(report.format()))
        sys.exit(1)

_main()
"""
BOOTSTRAP = (
    BOOTSTRAP.replace("compile(_GUARD", f"compile({_GUARD!r}")
    .replace("os._exit(EXIT_MEMORY)", f"os._exit({EXIT_MEMORY})")
    .replace("os._exit(EXIT_SETUP)", f"os._exit({EXIT_SETUP})")
)
