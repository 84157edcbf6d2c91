"""Host functions: trusted code the app registers, run in the dispatcher,
called by handlers with `ctx.call(name, args)` (docs/tenant-data.md).

    @tenantq.host_function("orders.for_month")
    def orders_for_month(args, ctx):          # ctx: HostContext
        with ctx.db() as conn:                # the job's tenant, fixed by the host
            return conn.execute(...).fetchall()

    @tenantq.handler("reports.monthly", host_functions=["orders.for_month"])
    def monthly(payload, ctx):
        return ctx.call("orders.for_month", {"month": 9})

A sandboxed handler's call crosses to the host over a Unix socket that the
host binds into that batch's sandbox only (`CallServer`, hostfn.sock next to
the egress proxy's); an inline handler's call is made directly, through the
same `CallGate`. Everything that arrives is hostile input (docs/security.md,
rule F1): the gate answers every call from the host's own records, never
from the guest's claims. The tenant and the actor are the batch's and the
running job's (the host's bookkeeping, rule H2), not anything in the args;
only the functions the running job's handler declares, and its tenant's
restriction allows (`tenantq tenant set T --host-functions`), can be called;
sizes, calls per batch, time per call and calls in flight are bounded
(`CallLimits`). What the calls cost is counted here, by the host: per job
(`take_job`, the attempt's record) and per batch (`batch_record`).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Collection
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

from tenantq.domain import validation
from tenantq.errors import HostFunctionError, InvalidInput, NoAppDatabase
from tenantq.guest.protocol import MAX_CALL_REQUEST_BYTES, MAX_JSON_DEPTH, json_depth
from tenantq.registry import REGISTRY, Registry

# calls listed per attempt (all are counted)
MAX_RECORDED_CALLS = 100


@dataclass(frozen=True)
class CallLimits:
    """What one batch's calls may cost the host (stated in docs/tenant-data.md)."""

    max_request_bytes: int = MAX_CALL_REQUEST_BYTES
    max_response_bytes: int = 1 << 20
    calls_per_batch: int = 1000
    call_timeout: float = 10.0
    in_flight_per_batch: int = 4
    # the host's side of the socket (dispatch/executors/host_calls.py): how long it
    # waits for a request's bytes, and the connections a batch may hold
    # open beyond its calls in flight (more are closed unanswered)
    read_timeout: float = 10.0
    spare_connections: int = 4

    def __post_init__(self) -> None:
        for name in ("max_request_bytes", "max_response_bytes", "calls_per_batch", "in_flight_per_batch"):
            if getattr(self, name) < 1:
                raise InvalidInput(f"host function limit {name} must be at least 1")
        if self.spare_connections < 0:
            raise InvalidInput("host function limit spare_connections must be at least 0")
        if not 0 < self.read_timeout <= 300:
            raise InvalidInput(f"host function read_timeout must be in (0, 300] s, got {self.read_timeout:g}")
        if not 0 < self.call_timeout <= 3600:
            raise InvalidInput(f"host function call_timeout must be in (0, 3600] s, "
                               f"got {self.call_timeout:g}")


def limits_from_settings() -> CallLimits:
    """The limits from TENANTQ_HOST_CALL* (settings.py)."""
    from tenantq.settings import Settings

    settings = Settings()
    return CallLimits(max_request_bytes=settings.host_call_max_request_bytes,
                      max_response_bytes=settings.host_call_max_response_bytes,
                      calls_per_batch=settings.host_calls_per_batch, call_timeout=settings.host_call_timeout,
                      in_flight_per_batch=settings.host_calls_in_flight,
                      read_timeout=settings.host_call_read_timeout,
                      spare_connections=settings.host_call_spare_connections)


@dataclass(frozen=True)
class HostFunction:
    name: str
    func: Callable[[dict[str, Any], HostContext], Any]
    timeout: float | None = None


@dataclass(frozen=True)
class HostContext:
    """What a host function knows: set by the host from the batch and the
    running job, never from the call's arguments."""

    tenant: str
    actor: str | None
    job_id: int
    kind: str
    database: Any = field(default=None, repr=False)

    def db(self) -> Any:
        """The application's database in this tenant's context, a fresh
        transaction per `with` (tenant_data.py): nothing a call sets on it
        outlives the call."""
        if self.database is None:
            raise NoAppDatabase("ctx.db() in a host function: this worker has no application database "
                                "(TENANTQ_APP_DATABASE_URL or --app-db)")
        from tenantq.tenant_data import TenantDb

        return TenantDb(self.database, self.tenant, self.actor)


def host_function(name: str, *, timeout: float | None = None,
                  registry: Registry | None = None) -> Callable[[Any], Any]:
    """Register `func(args, ctx)` as the host function `name`."""
    validation.kind(name, "host function name")
    if timeout is not None and not 0 < timeout <= 3600:
        raise InvalidInput(f"host function {name!r}: timeout must be in (0, 3600] s, got {timeout}")

    def register(func: Any) -> Any:
        (registry or REGISTRY).add_host_function(HostFunction(name, func, timeout))
        return func

    return register


@dataclass(frozen=True)
class Caller:
    """The job a call is made for, from the host's own records."""

    job_id: int
    kind: str
    actor: str | None


@dataclass
class CallStats:
    """A batch's calls. `calls` are the ones let through (they count against
    `calls_per_batch`), `refused` the ones the gate turned away, `errors`
    the calls let through that failed (raised, overran, bad result)."""

    calls: int = 0
    refused: int = 0
    errors: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    seconds: float = 0.0

    def record(self) -> dict[str, Any]:
        return {"calls": self.calls, "refused": self.refused, "errors": self.errors,
                "bytes_in": self.bytes_in, "bytes_out": self.bytes_out, "seconds": round(self.seconds, 6)}


def merge_counts(first: dict[str, Any] | None, second: dict[str, Any]) -> dict[str, Any]:
    """Two batch records (`CallStats.record`) as one: their sums."""
    if first is None:
        return dict(second)
    return {key: round(float(first.get(key, 0)) + float(value), 6) if key == "seconds"
            else int(first.get(key, 0)) + int(value) for key, value in second.items()}


@dataclass
class JobCalls:
    """One job's calls, for its attempt's record."""

    count: int = 0
    errors: int = 0
    seconds: float = 0.0
    calls: list[dict[str, Any]] = field(default_factory=list)

    def record(self) -> dict[str, Any]:
        return {"count": self.count, "errors": self.errors, "seconds": round(self.seconds, 6),
                "calls": self.calls}


class CallGate:
    """One batch's door to the host functions."""

    def __init__(self, registry: Registry, tenant: str, current: Callable[[], Caller | None], *,
                 database: Any = None, limits: CallLimits | None = None,
                 allowed: Collection[str] | None = None) -> None:
        self.registry = registry
        self.tenant = tenant
        self.current = current
        self.database = database
        self.limits = limits or CallLimits()
        # the tenant's restriction (tenants.host_functions, claimed with the
        # batch); None: every function a handler declares
        self.allowed = None if allowed is None else frozenset(allowed)
        self.stats = CallStats()
        self._jobs: dict[int, JobCalls] = {}
        self._lock = threading.Lock()
        self._in_flight = 0
        # The batch's own threads, as many as it may have calls in flight:
        # a call starts at once or is refused (never queued behind another
        # batch's, so one tenant's slow functions cannot hold up another's
        # calls, and a call's timeout is its run time). One that overruns
        # is answered at its timeout while it runs on; it still counts as in
        # flight until it returns.
        self._threads: ThreadPoolExecutor | None = None
        self._closed = False

    def call(self, name: object, args: object, request_bytes: int = 0, *,
             caller: Caller | bool | None = True) -> dict[str, Any]:
        """A reply record: {"ok": true, "result": ...} or {"ok": false, "error": "..."}.
        `caller`: the job the request belongs to, as the host recorded it when
        the connection came (None: none was running); default: the job in
        flight now."""
        # the name as recorded (metrics, the attempt's row): the guest's
        # string only if it is a valid name, never NUL bytes, escapes or
        # markup that Postgres or a page would choke on (rule F1)
        shown = _recordable(name)
        started = time.monotonic()
        who = self.current() if caller is True else caller
        try:
            result = self._call(name, args, request_bytes, who)
        except HostFunctionError as exc:
            return self._done(shown, "refused" if exc.args[0].startswith("refused") else "error",
                              started, {"ok": False, "error": str(exc)}, who)
        return self._done(shown, "ok", started, {"ok": True, "result": result}, who)

    def refuse(self, reason: str, caller: Caller | None = None) -> dict[str, Any]:
        """A request that never got as far as a name (the server's checks)."""
        return self._done("?", "refused", time.monotonic(), {"ok": False, "error": reason}, caller)

    def _done(self, name: str, outcome: str, started: float, reply: dict[str, Any],
              caller: Caller | bool | None) -> dict[str, Any]:
        from tenantq.observe import metrics  # host only: `import tenantq` in a sandbox needs none of it

        seconds = time.monotonic() - started
        label = name if self.registry.host_function(name) is not None else "unknown"
        metrics.HOST_FUNCTION_CALLS.labels(label, outcome).inc()
        with self._lock:
            self.stats.seconds += seconds
            self.stats.refused += outcome == "refused"
            self.stats.errors += outcome == "error"
            if isinstance(caller, Caller):
                job = self._jobs.setdefault(caller.job_id, JobCalls())
                job.count += 1
                job.errors += outcome != "ok"
                job.seconds += seconds
                if len(job.calls) < MAX_RECORDED_CALLS:
                    job.calls.append({"name": name, "outcome": outcome, "ms": round(seconds * 1000, 3)})
        return reply

    def close(self) -> None:
        """The batch has ended: its threads go as their calls return (a
        function that overran still runs to its end; none is waited for)."""
        with self._lock:
            threads, self._threads = self._threads, None
            self._closed = True
        if threads is not None:
            threads.shutdown(wait=False, cancel_futures=True)

    def take_job(self, job_id: int) -> dict[str, Any] | None:
        """The calls made for `job_id` (None: none), for its attempt's
        record; a call still answering for it later is counted for the batch only."""
        with self._lock:
            job = self._jobs.pop(job_id, None)
        return None if job is None else job.record()

    def batch_record(self) -> dict[str, Any] | None:
        """The batch's counts (None when nothing was called)."""
        with self._lock:
            if not (self.stats.calls or self.stats.refused):
                return None
            return self.stats.record()

    def _call(self, name: object, args: object, request_bytes: int, caller: Caller | bool | None) -> Any:
        limits = self.limits
        if not isinstance(caller, Caller):
            raise HostFunctionError("refused: no job of this batch is running")
        if not isinstance(name, str) or len(name) > 200:
            raise HostFunctionError("refused: the function name must be a string of at most 200 characters")
        handler = self.registry.get(caller.kind)
        if handler is None or name not in handler.host_functions:
            raise HostFunctionError(f"refused: handler {caller.kind!r} does not declare host function "
                                    f"{name!r}")
        if self.allowed is not None and name not in self.allowed:
            raise HostFunctionError(f"refused: tenant {self.tenant!r} may not call host function {name!r} "
                                    "(tenantq tenant set --host-functions)")
        function: HostFunction | None = self.registry.host_function(name)
        if function is None:
            raise HostFunctionError(f"refused: no host function {name!r} is registered on this worker")
        if not isinstance(args, dict):
            raise HostFunctionError("refused: args must be a JSON object")
        if request_bytes > limits.max_request_bytes:
            raise HostFunctionError(f"refused: args of {request_bytes} bytes exceed "
                                    f"{limits.max_request_bytes}")
        with self._lock:
            if self._closed:
                raise HostFunctionError("refused: the batch has ended")
            if self.stats.calls >= limits.calls_per_batch:
                raise HostFunctionError(f"refused: this batch made its {limits.calls_per_batch} calls")
            if self._in_flight >= limits.in_flight_per_batch:
                raise HostFunctionError(f"refused: {limits.in_flight_per_batch} calls of this batch are "
                                        "already running")
            self.stats.calls += 1
            self.stats.bytes_in += request_bytes
            self._in_flight += 1
            if self._threads is None:
                self._threads = ThreadPoolExecutor(max_workers=limits.in_flight_per_batch,
                                                   thread_name_prefix="tenantq-hostfn")
            threads = self._threads
        ctx = HostContext(self.tenant, caller.actor, caller.job_id, caller.kind, self.database)
        future: Future[Any] = threads.submit(self._run, function, dict(args), ctx)
        timeout = function.timeout or limits.call_timeout
        try:
            value = future.result(timeout=timeout)
        except FutureTimeout:
            raise HostFunctionError(f"{name}: no answer within {timeout:g} s") from None
        except HostFunctionError:
            raise
        except Exception as exc:
            raise HostFunctionError(f"{name} raised {type(exc).__name__}: {_one_line(exc)}") from None
        try:
            body = json.dumps(value, allow_nan=False)
        except (TypeError, ValueError, RecursionError) as exc:
            raise HostFunctionError(f"{name} returned something that is not JSON: {_one_line(exc)}") from None
        if len(body) > limits.max_response_bytes:
            raise HostFunctionError(f"{name} returned {len(body)} bytes; the limit is "
                                    f"{limits.max_response_bytes}")
        if json_depth(value) > MAX_JSON_DEPTH - 2:
            raise HostFunctionError(f"{name} returned JSON nested more than {MAX_JSON_DEPTH - 2} levels deep")
        with self._lock:
            self.stats.bytes_out += len(body)
        return json.loads(body)  # what the guest gets: the JSON, not the host's objects

    def _run(self, function: HostFunction, args: dict[str, Any], ctx: HostContext) -> Any:
        from tenantq.observe import metrics

        started = time.monotonic()
        try:
            return function.func(args, ctx)
        finally:
            metrics.HOST_FUNCTION_SECONDS.labels(function.name).observe(time.monotonic() - started)
            with self._lock:
                self._in_flight -= 1

    def inline_caller(self) -> Callable[[str, dict[str, Any]], Any]:
        """ctx.call for an inline handler: the same gate, the same JSON."""

        def call(name: str, args: dict[str, Any]) -> Any:
            try:
                request = json.dumps(args, allow_nan=False)
            except (TypeError, ValueError, RecursionError) as exc:
                raise HostFunctionError(f"ctx.call({name!r}): args are not JSON: {_one_line(exc)}") from None
            reply = self.call(name, json.loads(request), len(request))
            if not reply["ok"]:
                raise HostFunctionError(reply["error"])
            return reply["result"]

        return call


def _recordable(name: object) -> str:
    try:
        return validation.kind(name, "host function name")
    except InvalidInput:
        return "?"


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:500]


