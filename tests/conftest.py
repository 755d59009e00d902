"""Shared pytest set-up. Fixture modules live in tests/fixtures/ and are registered here."""

pytest_plugins: list[str] = ["tests.fixtures.redis_server", "tests.fixtures.tcp_proxy", "tests.fixtures.service",
                           "tests.fixtures.torch_threads"]
