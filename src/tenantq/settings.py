"""Typed settings, read from TENANTQ_* environment variables."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Final, Literal

import platformdirs
from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

if TYPE_CHECKING:
    from tenantq.tenant_data import AppDatabaseConfig

_SCHEMA_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")

# A worker's defaults, written once: the TENANTQ_WORKER_* settings below
# default to them, `tenantq worker`'s options default to those settings,
# and dispatch/config.py's WorkerConfig (the library's Worker) to these.
DEFAULT_WORKER_CONCURRENCY = 4
DEFAULT_WORKER_BATCH_SIZE = 10
DEFAULT_WORKER_LEASE_SECONDS = 30.0
DEFAULT_WORKER_POLL_SECONDS = 1.0
DEFAULT_WORKER_BACKOFF_BASE = 2.0
DEFAULT_WORKER_BACKOFF_CAP = 600.0
DEFAULT_WORKER_FAIR_BY: Final = "jobs"
DEFAULT_WORKER_QUANTUM_SECONDS = 1.0
# fairness/slots.py's DEFAULT_INTERACTIVE_SHARE (tests/unit/test_cli_layout.py checks they agree)
DEFAULT_WORKER_INTERACTIVE_SHARE = 0.3
DEFAULT_WORKER_SANDBOX: Final = "auto"
DEFAULT_WORKER_SNAPSHOTS: Final = "auto"
DEFAULT_WORKER_KEEP_WARM = 0.0
DEFAULT_WORKER_MAX_BATCHES_PER_SANDBOX = 50
DEFAULT_WORKER_READY_POOL = 0
DEFAULT_WORKER_WORK_MB = 128


def default_data_dir() -> Path:
    """`/var/lib/tenantq` for root (a system service), else the user's data dir.

    Root gets a system path because the embedded Postgres runs as an
    unprivileged user and must be able to traverse every parent directory:
    under /root that would mean opening /root to everyone.
    """
    if os.geteuid() == 0:
        return Path("/var/lib/tenantq")
    return Path(platformdirs.user_data_dir("tenantq"))


class Settings(BaseSettings):
    """Process-wide configuration. Every field maps to `TENANTQ_<FIELD>`."""

    model_config = SettingsConfigDict(env_prefix="TENANTQ_", extra="ignore")

    database_url: str | None = Field(
        default=None,
        description="Postgres DSN; unset means the embedded Postgres under data_dir.",
    )
    schema_name: str = Field(
        default="tenantq",
        validation_alias="TENANTQ_SCHEMA",
        description="Postgres schema that holds tenantq's tables.",
    )
    data_dir: Path = Field(
        default_factory=default_data_dir,
        description="Where the embedded Postgres and sandbox templates live.",
    )

    metrics_top_tenants: int = Field(
        default=20, ge=1, le=10_000,
        description="Tenants with their own label in queue metrics; the rest are summed as 'other'.",
    )

    egress_allow_networks: str = Field(
        default="",
        description="Comma-separated CIDRs the egress proxy may connect to even though they are "
                    "loopback/private (e.g. 127.0.0.1/32 for a test server). Default: none.",
    )

    egress_upstream_ca: str | None = Field(
        default=None,
        description="A CA file the egress proxy trusts for upstream TLS besides the system's (private CAs).",
    )

    egress_max_names_per_batch: int = Field(
        default=256, ge=1, le=100_000,
        description="Distinct host names one batch's egress may ask for; past it a new name is refused "
                    "before DNS (rule E3 of docs/security.md).")
    pool_size: int = Field(
        default=2, ge=0, le=64,
        description="Sandbox API: ready sandboxes kept per template (and driver and limits) by a "
                    "process that has created one of that kind; 0 turns the pool off.",
    )

    # ctx.db(): the application's database (tenant_data.py, docs/tenant-data.md)
    app_database_url: str | None = Field(
        default=None, description="The application's database for inline handlers' ctx.db() "
                                  "(worker --app-db overrides it); unset: ctx.db() raises.")
    app_db_role: str | None = Field(default=None,
                                    description="SET LOCAL ROLE for every ctx.db() transaction.")
    app_db_tenant_setting: str = Field(default="app.current_tenant_id",
                                       description="The setting ctx.db() sets to the job's tenant.")
    app_db_actor_setting: str = Field(default="app.current_actor",
                                      description="The setting ctx.db() sets to the job's actor "
                                                  "('' when none).")
    app_db_pool_size: int = Field(default=10, ge=1, le=1000,
                                  description="Connections the worker's ctx.db() pool may hold.")

    # host functions (host_functions.py, docs/tenant-data.md): per batch
    host_call_timeout: float = Field(default=10.0, gt=0, le=3600,
                                     description="Seconds a ctx.call waits for its host function.")
    host_calls_per_batch: int = Field(default=1000, ge=1, le=1_000_000,
                                      description="ctx.call calls a batch may make.")
    host_calls_in_flight: int = Field(default=4, ge=1, le=64,
                                      description="ctx.call calls of a batch running at once.")
    host_call_max_request_bytes: int = Field(default=64 << 10, ge=1, le=64 << 10,
                                             description="The largest ctx.call request (name and args).")
    host_call_max_response_bytes: int = Field(default=1 << 20, ge=1, le=1 << 20,
                                              description="The largest host function result (JSON).")
    host_call_read_timeout: float = Field(default=10.0, gt=0, le=300,
                                          description="Seconds the host waits for a request's bytes.")
    host_call_spare_connections: int = Field(default=4, ge=0, le=64,
                                             description="Connections a batch may hold open beyond its "
                                                         "calls in flight.")

    # `tenantq worker`'s defaults (its options win); the ranges are the options'
    worker_concurrency: int = Field(default=DEFAULT_WORKER_CONCURRENCY, ge=1, le=256,
                                    description="Slots of a worker: batches it runs at once (--concurrency).")
    worker_batch_size: int = Field(default=DEFAULT_WORKER_BATCH_SIZE, ge=1, le=10_000,
                                   description="Most jobs a slot leases at once, all of one tenant "
                                               "(--batch-size).")
    worker_lease_seconds: float = Field(default=DEFAULT_WORKER_LEASE_SECONDS, ge=0.5, le=86_400,
                                        description="A batch's lease, heartbeated three times per period "
                                                    "(--lease-seconds).")
    worker_poll_seconds: float = Field(default=DEFAULT_WORKER_POLL_SECONDS, ge=0.05, le=60,
                                       description="How often an idle slot looks for work when no NOTIFY "
                                                   "arrives (--poll-seconds).")
    worker_backoff_base: float = Field(default=DEFAULT_WORKER_BACKOFF_BASE, ge=0, le=3600,
                                       description="Retry backoff base in seconds: full jitter, doubling "
                                                   "per attempt (--backoff-base).")
    worker_backoff_cap: float = Field(default=DEFAULT_WORKER_BACKOFF_CAP, ge=0, le=86_400,
                                      description="The longest retry backoff in seconds (--backoff-cap).")
    worker_fair_by: Literal["jobs", "runtime"] = Field(
        default=DEFAULT_WORKER_FAIR_BY,
        description="The fair scheduler's cost: one unit per job, or measured run seconds (--fair-by).")
    worker_quantum_seconds: float = Field(default=DEFAULT_WORKER_QUANTUM_SECONDS, ge=0.001, le=3600,
                                          description="With fair-by runtime: credit per turn and unit of "
                                                      "weight (--quantum-seconds).")
    worker_interactive_share: float = Field(default=DEFAULT_WORKER_INTERACTIVE_SHARE, ge=0, le=1,
                                            description="Share of a worker's slots reserved for interactive "
                                                        "work, lent out when unused (--interactive-share).")
    worker_sandbox: Literal["auto", "gvisor", "process", "inline"] = Field(
        default=DEFAULT_WORKER_SANDBOX, description="Where a worker's batches run (--sandbox).")
    worker_snapshots: Literal["auto", "off"] = Field(
        default=DEFAULT_WORKER_SNAPSHOTS,
        description="Restore sandboxes from the app's warm template where the driver can (--snapshots).")
    worker_keep_warm: float = Field(default=DEFAULT_WORKER_KEEP_WARM, ge=0, le=86_400,
                                    description="Idle seconds a tenant's sandbox is kept for its next batch; "
                                                "0: never (--keep-warm).")
    worker_max_batches_per_sandbox: int = Field(default=DEFAULT_WORKER_MAX_BATCHES_PER_SANDBOX, ge=1,
                                                le=100_000,
                                                description="Batches a kept-warm sandbox serves before it is "
                                                            "replaced (--max-batches-per-sandbox).")
    worker_ready_pool: int = Field(default=DEFAULT_WORKER_READY_POOL, ge=0, le=64,
                                   description="Pristine sandboxes a worker keeps ready ahead of demand "
                                               "(--ready-pool).")
    worker_work_mb: int = Field(default=DEFAULT_WORKER_WORK_MB, ge=1, le=65_536,
                                description="Quota of a sandbox's work dir in MiB (--work-mb).")

    # retention of finished jobs: a number of seconds or 30m, 12h, 7d, 2w
    sandbox_paths: str = Field(
        default="", description="Files or directories (comma-separated) every sandbox of a worker sees "
        "read-only at their paths, besides the app's imports (rule M1 of docs/security.md); "
        "--sandbox-path adds more.")
    retain_done: str = Field(default="7d", description="How long done jobs are kept.")
    retain_cancelled: str = Field(default="7d", description="How long cancelled jobs are kept.")
    retain_dead: str = Field(default="30d", description="How long dead jobs are kept.")
    retain_batches: str = Field(default="7d", description="How long the record of an ended batch (and its "
                                                          "egress-block rows) is kept.")

    def retention(self) -> dict[str, float]:
        """Seconds per final status (InvalidInput, one line, for a bad value)."""
        from tenantq.domain.validation import duration

        return {"done": duration(self.retain_done, "TENANTQ_RETAIN_DONE"),
                "cancelled": duration(self.retain_cancelled, "TENANTQ_RETAIN_CANCELLED"),
                "dead": duration(self.retain_dead, "TENANTQ_RETAIN_DEAD")}

    def batch_retention(self) -> float:
        """Seconds an ended batch's record is kept (InvalidInput, one line, when bad)."""
        from tenantq.domain.validation import duration

        return duration(self.retain_batches, "TENANTQ_RETAIN_BATCHES")

    def app_database(self, url: str | None = None, role: str | None = None) -> AppDatabaseConfig | None:
        """The ctx.db() configuration (`url`/`role` from the command line
        win), or None without a URL; InvalidInput, one line, when bad."""
        from tenantq.tenant_data import AppDatabaseConfig

        chosen = url or self.app_database_url
        if not chosen:
            return None
        return AppDatabaseConfig(url=chosen, role=role or self.app_db_role,
                                 tenant_setting=self.app_db_tenant_setting,
                                 actor_setting=self.app_db_actor_setting, pool_size=self.app_db_pool_size)

    def sandbox_path_list(self) -> list[str]:
        return [p.strip() for p in self.sandbox_paths.split(",") if p.strip()]

    def egress_networks(self) -> list[str]:
        return [n.strip() for n in self.egress_allow_networks.split(",") if n.strip()]

    @field_validator("egress_allow_networks")
    @classmethod
    def _networks_parse(cls, value: str) -> str:
        import ipaddress

        for net in (n.strip() for n in value.split(",") if n.strip()):
            ipaddress.ip_network(net, strict=False)
        return value

    @field_validator("schema_name")
    @classmethod
    def _schema_is_identifier(cls, value: str) -> str:
        if not _SCHEMA_NAME.match(value):
            raise ValueError(f"schema name must match {_SCHEMA_NAME.pattern}, got {value!r}")
        return value
