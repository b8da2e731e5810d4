"""The repair tests' fixtures (a SQLite state, in-memory memory servers, a clock, a
repair manager), shared with the move tests."""
from tests.unit.server.controller.test_repair import clock, manager, servers, state  # noqa: F401
