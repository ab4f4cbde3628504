"""No folder at the repository's root shadows another package: from the root, ``import verifiers`` and
``import envs`` must not find mmgrpo's own built-in modules (issue 52: Prime Intellect's ``verifiers`` package
was hidden by a top-level ``verifiers/`` folder)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_root_has_no_shadowing_packages():
    code = (
        "import importlib.util, json\n"
        "out = {}\n"
        "for name in ('verifiers', 'envs'):\n"
        "    spec = importlib.util.find_spec(name)\n"
        "    out[name] = spec.origin if spec else None\n"
        "print(json.dumps(out))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    import json

    found = json.loads(out.stdout)
    for name, origin in found.items():
        assert origin is None or not str(origin).startswith(str(ROOT / name)), (name, origin)
    # the built-ins still import under their documented names
    import mmgrpo.envs.counting  # noqa: F401
    import mmgrpo.verifiers.answers  # noqa: F401
