"""One writer per run: ``{output_dir}/.mmgrpo.lock``, held by the command that writes the run.

``mmgrpo train`` (and ``mmgrpo.run``, which it calls), ``sft`` and ``demo`` hold the lock of their output
folder while they run, so that a second command started into the same folder, even at the same moment,
stops at once with one line naming the folder and the process that holds it (two runs writing one folder
interleave their metrics and keep the final model of whichever saved last).

The lock is an advisory ``fcntl.flock`` on the file, so the kernel releases it when its process ends, however
it ends; the file's text (pid, host, command, start time) only names the holder. A file left by a process
that was killed (SIGKILL, a power cut) is therefore not held, and the next command takes it over with a
line saying so. On release the file is removed; a process that took the lock on a file another one removed
meanwhile notices (the path no longer names the inode it locked) and takes it again.

A folder that the command created (with any parents it created) and left without a single file, as a run
that fails before writing does, is removed on release: a failed command leaves no empty output_dir.

Under ``accelerate launch`` the processes of one run share the lock: only the main one (global rank 0)
takes it, and the others write nothing that the main process does not coordinate.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

from mmgrpo.errors import MmgrpoError
from mmgrpo.model.io import first_missing, remove_if_no_files

LOCK_NAME = ".mmgrpo.lock"
RANK_VARIABLES = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")
"""Where launchers (torchrun and ``accelerate launch``, Open MPI, MPICH, PMIx) put the global rank."""


class RunLockedError(MmgrpoError):
    """Another live process holds the output folder's lock."""


def is_launch_main_process() -> bool:
    """True unless a launcher started this process as a rank other than 0 (a single process is rank 0)."""
    for name in RANK_VARIABLES:
        if os.environ.get(name, "").strip():
            return os.environ[name].strip() == "0"
    return True


def _holder(text: str) -> dict:
    try:
        found = json.loads(text)
    except ValueError:
        return {}
    return found if isinstance(found, dict) else {}


HOLDER_WAIT_S = 2.0
"""How long a command that finds the lock held waits for its holder to write its details (pid, host, command):
the holder writes them just after taking the lock, which on a loaded machine can be a moment later."""


def _read_holder(fd: int) -> dict:
    deadline = time.monotonic() + HOLDER_WAIT_S
    while True:
        holder = _holder(os.pread(fd, 4096, 0).decode(errors="replace"))
        if holder.get("pid") or time.monotonic() >= deadline:
            return holder
        time.sleep(0.02)


def _describe(holder: dict) -> str:
    if not holder.get("pid"):
        return "another process (it is starting: its details are not written yet)"
    since = holder.get("since")
    when = f", since {time.strftime('%H:%M:%S', time.localtime(since))}" if since else ""
    return f"`{holder.get('command', 'mmgrpo')}` (pid {holder['pid']} on {holder.get('host', '?')}{when})"


class RunLock:
    """The lock of ``folder`` (created, with its parents, when missing) for ``command`` (e.g. "mmgrpo train").

    ``acquire`` raises :class:`RunLockedError` when another live process holds it; ``release`` removes the
    file. Use it as a context manager. In a process that is not a launch's main one it does nothing.
    """

    def __init__(self, folder: str | Path, command: str, *, what: str = "output_dir"):
        self.folder, self.command, self.what = Path(folder), command, what
        self.path = self.folder / LOCK_NAME
        self.fd: int | None = None
        self.created: Path | None = None  # the outermost folder this lock created
        self.took_over: dict | None = None  # the holder recorded in a stale lock file that was taken over

    def acquire(self) -> RunLock:
        if not is_launch_main_process():
            return self
        if self.folder.exists() and not self.folder.is_dir():
            raise MmgrpoError(f"{self.what} '{self.folder}' is a file, not a folder: give a folder path")
        self.created = first_missing(self.folder)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            self._lock()
        except OSError as exc:
            self.release()
            raise MmgrpoError(
                f"{self.what} '{self.folder}' cannot be written: {exc.strerror or exc}. Choose a folder you can "
                "write to (and with free space)."
            ) from exc
        except BaseException:
            self.release()
            raise
        return self

    def _lock(self) -> None:
        try:
            import fcntl
        except ImportError:  # not POSIX: no advisory locks; runs are not protected against each other
            return
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_holder(fd)
                os.close(fd)
                raise RunLockedError(
                    f"{self.what} '{self.folder}' is in use by {_describe(holder)}: two runs writing one folder "
                    "mix their metrics and models. Wait for it to end, stop it, or choose another folder."
                ) from None
            except BaseException:
                os.close(fd)
                raise
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # its holder released and removed the file between our open and lock: again
        self.fd = fd
        old = _holder(os.pread(fd, 4096, 0).decode(errors="replace"))
        if old.get("pid"):  # a file nobody held: its process ended without removing it
            self.took_over = old
        record = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "command": self.command,
            "since": round(time.time(), 3),
        }
        text = (json.dumps(record) + "\n").encode()
        os.pwrite(fd, text, 0)  # then cut what an older, longer record left: the file is never empty while held
        os.ftruncate(fd, len(text))
        if self.took_over is not None:
            print(
                f"mmgrpo: took over the lock of '{self.folder}' left by pid {old['pid']} on {old.get('host', '?')} "
                f"({old.get('command', 'mmgrpo')}), which ended without releasing it",
                file=sys.stderr,
                flush=True,
            )

    def release(self) -> None:
        if self.fd is not None:
            try:
                self.path.unlink()  # before unlocking: a process that locks this inode next sees it is gone
            except FileNotFoundError:
                pass
            os.close(self.fd)  # closing releases the flock
            self.fd = None
        remove_if_no_files(self.created)
        self.created = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> bool:
        self.release()
        return False
