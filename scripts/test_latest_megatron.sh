#!/usr/bin/env bash
# Opt-in, not part of CI: run the emitter and layout tests against the newest
# megatron-core and torch from the registry, on Python 3.12 (megatron-core 0.17+
# needs >= 3.12). torch from the default index is a CUDA build of several GB.
#
#   bash scripts/test_latest_megatron.sh            # venv in ${TMPDIR:-/tmp}/megapipe-latest-megatron
#   PYTHON312=/path/to/python3.12 VENV=/some/dir bash scripts/test_latest_megatron.sh
set -euo pipefail
cd "$(dirname "$0")/.."

runs() { [[ -n "$1" ]] && "$1" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; }
if [[ -z "${PYTHON312:-}" ]]; then
    # a pyenv shim named python3.12 may exist yet refuse to run, so try each candidate
    for candidate in $(command -v python3.12 || true) \
        $(command -v pyenv >/dev/null && ls -d "$(pyenv root)"/versions/3.12*/bin/python 2>/dev/null); do
        if runs "$candidate"; then PYTHON312=$candidate; break; fi
    done
fi
if ! runs "${PYTHON312:-}"; then
    echo "test_latest_megatron: no working Python 3.12 found; set PYTHON312=/path/to/python3.12" >&2
    exit 2
fi
VENV=${VENV:-${TMPDIR:-/tmp}/megapipe-latest-megatron}

"$PYTHON312" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q --upgrade torch megatron-core
"$VENV/bin/python" -m pip install -q -e '.[test]'
"$VENV/bin/python" - <<'PY'
import sys
from importlib.metadata import version
print(f"python {sys.version.split()[0]}, torch {version('torch')}, megatron-core {version('megatron-core')}, "
      f"hydra-core {version('hydra-core')}")
PY
"$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/test_emit.py tests/test_megatron_layout.py
