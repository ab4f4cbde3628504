"""The red-team file once more as a user without a cgroup (issue 53: every guarantee holds with the trainer
as root with a cgroup and as a non-root user without one).

A test run as root (CI) runs ``tests/test_sandbox_redteam.py`` again as uid 65534 (``setpriv``: no groups,
no capabilities): that user may not create cgroups, so every run there is ``bwrap`` alone, and the sandbox
uses the trainer's own interpreter instead of the system's. Folders of this interpreter or checkout that
other users cannot enter (pyenv under ``/root``) are made reachable in a mount namespace of the test's own
(``unshare --mount``): an empty tmpfs of mode 0711 over the closed folder with the needed subfolder bound
back at the same path, so nothing on the host changes and every path stays the same. Run as another user,
the red-team file itself is that mode and this test has nothing to add.
"""

from __future__ import annotations

import os
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
USER = 65534


def closed_folders(paths: list[str]) -> dict[str, set[str]]:
    """For each folder that other users cannot enter on the way to ``paths``: the subfolders to keep."""
    found: dict[str, set[str]] = {}
    for path in paths:
        parts = os.path.realpath(path).split("/")
        for i in range(2, len(parts)):
            folder = "/".join(parts[:i])
            if not os.stat(folder).st_mode & stat.S_IXOTH:
                found.setdefault(folder, set()).add("/".join(parts[: i + 1]))
                break
    return found


def as_other_user_script(python: str, home: str, stash: str) -> str:
    """The shell lines, run as root in a new mount namespace, that open the way and drop to ``USER``."""
    lines = ["set -e", "mount --make-rprivate /"]
    for n, (folder, keep) in enumerate(
        sorted(closed_folders([sys.prefix, sys.base_prefix, python, str(ROOT)]).items())
    ):
        for m, sub in enumerate(sorted(keep)):
            lines += [f"mkdir {stash}/{n}-{m}", f"mount --bind {shlex.quote(sub)} {stash}/{n}-{m}"]
        lines.append(f"mount -t tmpfs -o mode=0711,size=64k tmpfs {shlex.quote(folder)}")
        for m, sub in enumerate(sorted(keep)):
            lines += [f"mkdir -p {shlex.quote(sub)}", f"mount --bind {stash}/{n}-{m} {shlex.quote(sub)}"]
    run = [
        "setpriv", f"--reuid={USER}", f"--regid={USER}", "--clear-groups", "--inh-caps=-all", "env", "-i",
        "PATH=/usr/bin:/bin", f"HOME={home}", f"TMPDIR={home}", "PYTHONDONTWRITEBYTECODE=1", "LANG=C.UTF-8",
        python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_sandbox_redteam.py",
    ]  # fmt: skip
    return "\n".join(lines + ["exec " + shlex.join(run)])


@pytest.mark.skipif(
    os.geteuid() != 0, reason="run as another user, tests/test_sandbox_redteam.py is this mode"
)
def test_the_red_team_holds_as_a_user_without_a_cgroup():
    missing = [tool for tool in ("unshare", "setpriv", "mount") if shutil.which(tool) is None]
    assert not missing, f"util-linux is missing ({', '.join(missing)}): apt-get install util-linux mount"
    home = tempfile.mkdtemp(prefix="mmgrpo-nonroot-")
    stash = tempfile.mkdtemp(prefix="mmgrpo-nonroot-stash-")
    try:
        os.chown(home, USER, USER)
        os.chmod(home, 0o700)
        script = as_other_user_script(os.path.realpath(sys.executable), home, stash)
        done = subprocess.run(
            ["unshare", "--mount", "sh", "-c", script],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        shutil.rmtree(home, ignore_errors=True)
        shutil.rmtree(stash, ignore_errors=True)
    tail = (done.stdout + done.stderr)[-4000:]
    assert done.returncode == 0, tail
    assert " passed" in tail and "skipped" not in tail.split("\n")[-2], tail
