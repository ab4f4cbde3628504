"""What one call of the python tool costs: median wall milliseconds per call of a trivial program, the
bubblewrap sandbox against the engine it replaced, alternated, one thread per process.

    python benchmarks/sandbox_overhead.py                      # this checkout: bwrap vs weak_sandbox=True
    git worktree add ../mmgrpo-before 2813913                   # the commit before bubblewrap
    python benchmarks/sandbox_overhead.py --before ../mmgrpo-before  # bwrap vs that checkout's engine

``weak_sandbox=True`` is the old engine (``unshare`` namespaces, a tmpfs, the Python guard). With
``--before DIR`` the "before" side imports mmgrpo from DIR (a worktree of an older commit) instead.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

TIMER = r"""
import json, sys, time
from mmgrpo.toolbox.sandbox import run_python
kwargs = json.loads(sys.argv[1])
run_python("print(1)", **kwargs)  # warm: probes and filters are built once per process
times = []
for _ in range(int(sys.argv[2])):
    t = time.perf_counter()
    r = run_python("print(sum(range(1000)))", **kwargs)
    times.append((time.perf_counter() - t) * 1000)
    assert r.stdout == "499500\n", r
print(json.dumps({"isolation": r.isolation, "times": times}))
"""


def side(root: str | None, kwargs: dict, calls: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if root:
        env["PYTHONPATH"] = root
    done = subprocess.run(
        [sys.executable, "-c", TIMER, json.dumps(kwargs), str(calls)],
        capture_output=True,
        text=True,
        env=env,
        cwd="/",
    )
    if done.returncode != 0:
        raise SystemExit(done.stderr[-2000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--before", help="a checkout whose mmgrpo is the 'before' side (default: weak_sandbox=True here)"
    )
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    before = (args.before, {}) if args.before else (None, {"weak_sandbox": True})
    after = (None, {})
    times: dict[str, list[float]] = {"before": [], "after": []}
    level = {}
    for _ in range(args.rounds):  # alternated: the machine is noisy
        for name, (root, kwargs) in (("before", before), ("after", after)):
            out = side(root, kwargs, args.calls)
            times[name] += out["times"]
            level[name] = out["isolation"]
    med = {k: statistics.median(v) for k, v in times.items()}
    for name in ("before", "after"):
        print(f"{name:6s} {level[name]:14s} median {med[name]:6.1f} ms per call ({len(times[name])} calls)")
    print(f"after / before: {med['after'] / med['before']:.2f}x")


if __name__ == "__main__":
    main()
