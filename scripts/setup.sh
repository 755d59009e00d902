#!/usr/bin/env bash
# Create .venv (if missing) and install kvstore into it.
#   scripts/setup.sh          the service and its CLI
#   scripts/setup.sh test     plus the test, lint and type-check tools
# Torch is installed first and pinned: a CPU build where the machine has one on hand; any
# looser spec lets pip pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)'; then
  echo "kvstore needs Python 3.11 or newer; $PY is $("$PY" --version 2>&1)" >&2
  exit 2
fi
if [ ! -x .venv/bin/python ] && ! "$PY" -m venv .venv; then
  rm -rf .venv
  echo "could not create a virtual environment with $PY -m venv;" \
       "on Debian/Ubuntu install the python3-venv package first" >&2
  exit 2
fi
PIP=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
.venv/bin/python -c 'import torch' 2>/dev/null || "${PIP[@]}" "torch==2.13.0"
if [ "${1:-}" = "test" ]; then
  "${PIP[@]}" -e '.[test]'
else
  "${PIP[@]}" -e .
fi
