"""The acceptance tests that start sandboxes (the demo, scale to zero, a
sandboxed job's cancel): in `./run test`'s heavy half, beside the sandbox
suites; the rest of tests/acceptance only talks to Postgres and runs in the
light half. Same fixtures as tests/acceptance."""

from tests.acceptance.conftest import cli

__all__ = ["cli"]
