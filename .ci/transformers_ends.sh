#!/usr/bin/env bash
# The low end of pyproject's transformers range: the fast tier's model tests (the families, the lean decode / pass /
# prompt paths and the kept-cache turns, the paths that lean on transformers' internals) under the lowest transformers
# that pyproject allows. The main fast tier (.ci/run) runs the newest, which pip resolves within the upper bound.
# The venv (MMGRPO_TF_LOW_VENV, default /opt/mmgrpo-tf-low, outside the repo) sees the system site-packages, so it
# reuses the torch, mmgrpo (editable) and test dependencies installed there and only shadows transformers (with the
# kernels version its "kernels" extra pins; the system's, pulled by the newest transformers, may not load on it).
# Created once; reused while its transformers is LOW. 70 s cold (venv + install), 60 s warm on 2 shared CPU cores.
set -euo pipefail
cd "$(dirname "$0")/.."
# pyproject.toml: "transformers>=5.20.0,<=5.25.0". 5.17.0 and below fail the lean paths' tests; 5.18.0 and 5.19.0 fail
# only test_model_families_all.py (no default config for vision-encoder-decoder; on 5.18.0 also Qwen2 / Qwen3 refused
# by the gate: the shrunken default configs keep 32 layer_types there, so the cache has layers that stay empty)
LOW=5.20.0
VENV=${MMGRPO_TF_LOW_VENV:-/opt/mmgrpo-tf-low}
have=$("$VENV/bin/python" -c "import transformers; print(transformers.__version__)" 2>/dev/null || true)
if [ "$have" != "$LOW" ]; then
  [ -x "$VENV/bin/python" ] || python3 -m venv --system-site-packages "$VENV"
  "$VENV/bin/python" -m pip install --quiet "transformers[kernels]==$LOW"
fi
"$VENV/bin/python" - "$LOW" <<'EOF'
import sys, torch, transformers
assert transformers.__version__ == sys.argv[1], transformers.__version__
print(f"low end: transformers {transformers.__version__}, torch {torch.__version__}")
EOF
tests=(tests/test_tiny_families.py tests/test_families.py tests/test_lean_decode.py tests/test_lean_pass.py
       tests/test_lean_prompt.py tests/test_kv_turns.py tests/test_policy.py)
[ -e tests/test_model_families_all.py ] && tests+=(tests/test_model_families_all.py)
"$VENV/bin/python" -m pytest -q -p no:cacheprovider "${tests[@]}"
