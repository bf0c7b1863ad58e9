"""Fixtures for the drill tests: a started fake metadata server and drill VMs that are always
torn down (processes, loop devices), even when a test fails."""
from drill_support import make_vm, metadata  # noqa: F401 - fixtures
