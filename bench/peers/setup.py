"""Create the peers' own virtualenv (bench/peers/.venv) and install PgQueuer and Procrastinate into it.

Usage: ``python3 bench/peers/setup.py`` with any python3 >= 3.10. Prints the venv's python path as the
only line on stdout (progress goes to stderr), so a caller can do ``PY=$(python3 bench/peers/setup.py)``.

Idempotent and quick once set up: the requirement list is stamped into the venv after a successful
install, and pip only runs again when the stamp is missing or differs. The installed versions are
recorded in bench/peers/versions.txt (``pip freeze`` of the venv).

This is deliberately not a setuptools script and imports nothing outside the standard library.
"""

from __future__ import annotations

import subprocess
import sys
import venv
from pathlib import Path

HERE = Path(__file__).resolve().parent
VENV = HERE / ".venv"
PYTHON = VENV / "bin" / "python"
STAMP = VENV / ".bench-peers-requirements"
VERSIONS = HERE / "versions.txt"
# Nothing pinned: the point is to compare against the peers as people install them today.
REQUIREMENTS = ["pgqueuer", "procrastinate", "psycopg[binary]", "asyncpg"]
# Every distribution whose version the results should cite.
REPORTED = ["pgqueuer", "procrastinate", "psycopg", "psycopg-binary", "psycopg-pool", "asyncpg"]


def log(message: str) -> None:
    print(f"[peers-setup] {message}", file=sys.stderr, flush=True)


def up_to_date() -> bool:
    """The venv exists, was installed with the current requirement list and still imports."""
    if not PYTHON.exists() or not STAMP.exists() or STAMP.read_text() != "\n".join(REQUIREMENTS):
        return False
    probe = [str(PYTHON), "-c", "import asyncpg, pgqueuer, procrastinate, psycopg"]
    return subprocess.run(probe, capture_output=True).returncode == 0


def install() -> None:
    if not PYTHON.exists():
        log(f"creating {VENV}")
        venv.EnvBuilder(with_pip=True, clear=True).create(VENV)
    log(f"pip install {' '.join(REQUIREMENTS)}")
    subprocess.run(
        [str(PYTHON), "-m", "pip", "install", "--upgrade", "--disable-pip-version-check", *REQUIREMENTS],
        check=True,
        stdout=sys.stderr,  # keep stdout for the python path
    )
    freeze = subprocess.run(
        [str(PYTHON), "-m", "pip", "freeze", "--disable-pip-version-check"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    VERSIONS.write_text(freeze)
    STAMP.write_text("\n".join(REQUIREMENTS))
    reported = [line for line in freeze.splitlines() if line.split("==")[0].lower() in REPORTED]
    log("installed: " + ", ".join(reported))


def main() -> None:
    if sys.version_info < (3, 10):  # noqa: UP036 - this script runs under any python3
        sys.exit("bench/peers/setup.py: PgQueuer and Procrastinate need python >= 3.10")
    if up_to_date():
        log(f"up to date ({VENV})")
    else:
        install()
    print(PYTHON)


if __name__ == "__main__":
    main()
