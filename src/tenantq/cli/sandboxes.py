"""`tenantq sandbox create|exec|cp|ls|rm`: the Sandbox API for operators
and shell scripts. Each command is one process; a sandbox made by
`create` lives on after it (to its TTL) and the others connect to it by id."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from tenantq.errors import InvalidInput


def _pairs(values: tuple[str, ...], what: str) -> dict[str, str]:
    out = {}
    for value in values:
        key, sep, rest = value.partition("=")
        if not sep or not key:
            raise InvalidInput(f"{what} must look like KEY=VALUE, got {value!r}")
        out[key] = rest
    return out


def _split(target: str) -> tuple[str | None, str]:
    """`tq-...:/path` -> (id, path); a host path -> (None, path)."""
    head, sep, tail = target.partition(":")
    if sep and head.startswith("tq-") and tail.startswith("/"):
        return head, tail
    return None, target


@click.group("sandbox")
def sandbox() -> None:
    """Sandboxes of the Sandbox API: make, use and remove them by id."""


@sandbox.command("create")
@click.option("--template", default="base", show_default=True)
@click.option("--ttl", "ttl_seconds", type=float, default=300, show_default=True, help="Seconds it lives.")
@click.option("--meta", multiple=True, help="KEY=VALUE metadata (repeatable).")
@click.option("--env", "envs", multiple=True, help="KEY=VALUE in every exec's environment (repeatable).")
@click.option("--tenant", default=None)
@click.option("--memory-mb", type=int, default=512, show_default=True)
@click.option("--cpus", type=float, default=1.0, show_default=True)
@click.option("--driver", default=None, help="auto (default), gvisor or process.")
def create(template: str, ttl_seconds: float, meta: tuple[str, ...], envs: tuple[str, ...],
           tenant: str | None, memory_mb: int, cpus: float, driver: str | None) -> None:
    """Make a sandbox and print its id."""
    import os

    from tenantq.sandbox.api import Sandbox

    os.environ["TENANTQ_POOL_SIZE"] = "0"  # this process makes one sandbox and exits: no pool to fill

    sbx = Sandbox.create(template=template, ttl_seconds=ttl_seconds, metadata=_pairs(meta, "--meta"),
                         envs=_pairs(envs, "--env"), tenant=tenant, memory_mb=memory_mb, cpus=cpus,
                         driver=driver)
    sbx.close()
    click.echo(sbx.id)


@sandbox.command("exec", context_settings={"ignore_unknown_options": True})
@click.argument("sandbox_id")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
@click.option("--timeout", "timeout_seconds", type=float, default=60, show_default=True)
@click.option("--cwd", default=None)
@click.option("--env", "envs", multiple=True, help="KEY=VALUE (repeatable).")
def exec_command(sandbox_id: str, command: tuple[str, ...], timeout_seconds: float, cwd: str | None,
                 envs: tuple[str, ...]) -> None:
    """Run COMMAND in the sandbox (one argument: a shell string; several: an
    argv), streaming its output; exits with its exit code (124 on timeout)."""
    from tenantq.sandbox.api import Sandbox

    sbx = Sandbox.connect(sandbox_id)
    try:
        cmd: str | list[str] = command[0] if len(command) == 1 else list(command)
        result = sbx.run(cmd, timeout_seconds=timeout_seconds, cwd=cwd, envs=_pairs(envs, "--env"),
                         on_stdout=lambda s: (sys.stdout.write(s), sys.stdout.flush()),
                         on_stderr=lambda s: (sys.stderr.write(s), sys.stderr.flush()))
    finally:
        sbx.close()
    if not result.ok:
        click.echo(f"tenantq: {result.reason}", err=True)
    if result.reason.startswith("timeout"):
        sys.exit(124)
    sys.exit(result.exit_code if result.exit_code is not None and result.exit_code >= 0 else 1)


@sandbox.command("cp")
@click.argument("source")
@click.argument("destination")
def copy(source: str, destination: str) -> None:
    """Copy a file into or out of a sandbox: `cp local.txt tq-ID:/work/in.txt`
    or `cp tq-ID:/work/out.json out.json`."""
    from tenantq.sandbox.api import Sandbox

    src_id, src_path = _split(source)
    dst_id, dst_path = _split(destination)
    if (src_id is None) == (dst_id is None):
        raise InvalidInput("cp copies between this host and one sandbox: exactly one side must be ID:/path")
    sbx = Sandbox.connect(src_id or dst_id or "")
    try:
        if src_id is not None:
            Path(dst_path).write_bytes(sbx.filesystem.read(src_path))
        else:
            sbx.filesystem.write(dst_path, Path(src_path).read_bytes())
    finally:
        sbx.close()


@sandbox.command("ls")
@click.argument("target", required=False)
@click.option("--meta", multiple=True, help="Only sandboxes with this KEY=VALUE metadata (repeatable).")
def list_command(target: str | None, meta: tuple[str, ...]) -> None:
    """List the live sandboxes, or with ID:/dir the files in a sandbox's directory."""
    from tenantq.sandbox.api import Sandbox

    if target is None:
        for info in Sandbox.list(metadata=_pairs(meta, "--meta")):
            tags = ",".join(f"{k}={v}" for k, v in sorted(info.metadata.items())) or "-"
            click.echo(f"{info.id}\t{info.driver}\t{info.template}\t{info.tenant or '-'}\t{tags}")
        return
    sandbox_id, path = _split(target)
    if sandbox_id is None:
        raise InvalidInput(f"ls takes ID:/dir, got {target!r}")
    sbx = Sandbox.connect(sandbox_id)
    try:
        for entry in sbx.filesystem.list(path):
            click.echo(f"{entry.type}\t{entry.size}\t{entry.name}")
    finally:
        sbx.close()


@sandbox.command("rm")
@click.argument("sandbox_ids", nargs=-1, required=True)
def remove(sandbox_ids: tuple[str, ...]) -> None:
    """End sandboxes and remove what they left on the host."""
    from tenantq.sandbox.api import remove_sandbox

    for sandbox_id in sandbox_ids:
        click.echo(f"{sandbox_id}: {'removed' if remove_sandbox(sandbox_id) else 'already gone'}")
