"""Shared pytest set-up. Fixture modules live in tests/fixtures/ and are registered here."""

pytest_plugins: list[str] = []
