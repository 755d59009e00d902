#!/usr/bin/env bash
# Lint, type-check, check the dependency rules (pyproject.toml [tool.importlinter]) and run the
# whole test suite; with arguments, pytest runs with them in the main environment instead. The
# tests start every service they need (Redis-protocol servers, the gRPC service, a browser where
# one is installed, vLLM engines) themselves. The engine tests (tests/engine) need vLLM, so they
# run in the engine environment (scripts/setup.sh engine).
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check kvstore replay policies tests scripts
.venv/bin/mypy
.venv/bin/lint-imports --no-cache
if [ $# -gt 0 ]; then
  .venv/bin/python -m pytest -q "$@"
  exit
fi
# The whole suite in two test processes (pytest-xdist), each test file whole in one of them: its
# module fixtures (a service, an engine) are shared by its tests as in a single process.
.venv/bin/python -m pytest -q -n 2 --dist loadfile
.venv-engine/bin/python -m pytest -q -n 2 --dist loadfile tests/engine
