"""Fixtures of the memory-server tests: a tcp plane in this process (:mod:`.planes`)."""
from tests.integration.memserver.planes import plane  # noqa: F401
