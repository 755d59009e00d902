"""Shared pytest set-up. Fixture modules live in tests/fixtures/ and are registered here.

tests/engine needs vLLM, which lives in the engine environment (.venv-engine) only; the main
environment does not collect it, and scripts/test.sh runs it there."""

import importlib.util

pytest_plugins: list[str] = ["tests.fixtures.redis_server", "tests.fixtures.tcp_proxy", "tests.fixtures.service",
                           "tests.fixtures.torch_threads"]
collect_ignore = [] if importlib.util.find_spec("vllm") is not None else ["engine"]
