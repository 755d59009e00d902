#!/usr/bin/env bash
# Lint, type-check, check the dependency rules (pyproject.toml [tool.importlinter]) and run the
# whole test suite. The tests start every service they need (Redis-protocol servers, the gRPC
# service, a browser where one is installed, vLLM engines) themselves. The engine tests
# (tests/engine) need vLLM, so they run in the engine environment (scripts/setup.sh engine).
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check kvstore replay policies tests scripts
.venv/bin/mypy
.venv/bin/lint-imports --no-cache
.venv/bin/python -m pytest -q "$@"
if [ $# -eq 0 ]; then
  .venv-engine/bin/python -m pytest -q tests/engine
fi
