"""Handlers: `@tenantq.handler(kind, ...)` registers a function for a kind."""

from __future__ import annotations

import importlib
import inspect
import os
import sys
import sysconfig
import threading
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

from tenantq.domain import validation
from tenantq.egress.policy import Rule, parse_rules
from tenantq.errors import HostFunctionError, InvalidInput, NoAppDatabase, TenantqError

Isolation = Literal["sandbox", "inline"]
# "job": a fresh process per job (the default; docs/security.md rule C2);
# "batch": consecutive jobs of this kind in one batch share one process
Process = Literal["job", "batch"]


class Cancellation:
    """`ctx.cancelled`: true once the job was asked to stop (`tenantq cancel`).

    An inline handler that runs long checks it (`if ctx.cancelled: return`,
    or `ctx.cancelled.wait(5)` instead of a sleep) and returns early; its job
    then ends `cancelled` whatever it returns. A sandboxed job is not asked:
    its process is killed.

    Every inline job gets one and almost none is ever waited on, so the
    Event behind `wait` is made on its first use (an Event per job was 6% of
    a no-op drain's Python time). `set` writes the flag before it reads the
    event, `wait` makes the event before it reads the flag: whichever comes
    second sees the other's write, so a wait cannot miss a set."""

    __slots__ = ("_event", "_flag")

    def __init__(self) -> None:
        self._flag = False
        self._event: threading.Event | None = None

    def __bool__(self) -> bool:
        return self._flag

    def is_set(self) -> bool:
        return self._flag

    def wait(self, timeout: float | None = None) -> bool:
        """Sleep up to `timeout` seconds, waking early (True) when cancelled."""
        if self._flag:
            return True
        with _EVENT_MAKING:
            if self._event is None:
                self._event = threading.Event()
            event = self._event
        if self._flag:
            event.set()
        return event.wait(timeout)

    def set(self) -> None:
        self._flag = True
        event = self._event
        if event is not None:
            event.set()


# two threads waiting on one Cancellation for the first time make one Event
_EVENT_MAKING = threading.Lock()


@dataclass(frozen=True)
class JobContext:
    """What a handler knows about the job it runs."""

    tenant: str
    job_id: int
    attempt: int
    kind: str
    max_attempts: int
    env: Mapping[str, str] = field(default_factory=dict)
    # the security envelope the job was enqueued with: who asked for it
    # (None: nobody said) and the request's context (a small JSON object)
    actor: str | None = None
    meta: Mapping[str, Any] = field(default_factory=dict)
    cancelled: Cancellation = field(default_factory=Cancellation)
    # the worker's application database (tenantq.tenant_data.AppDatabase)
    # for inline handlers; None in a sandbox, which never holds a connection
    database: Any = field(default=None, repr=False)
    # the job runs in a sandbox (the guest runner says so): ctx.db() then
    # explains that sandboxed code never gets a connection, whatever the
    # worker was started with
    sandboxed: bool = False
    # (name, args) -> result of a host function (host_functions.py): in a
    # sandbox a call over the batch's host-function socket, inline direct
    caller: Callable[[str, dict[str, Any]], Any] | None = field(default=None, repr=False)

    def call(self, name: str, args: dict[str, Any] | None = None) -> Any:
        """Call the host function `name` (declared in this handler's
        `host_functions=`) with a JSON object; its JSON result, or
        HostFunctionError with a one-line reason (docs/tenant-data.md)."""
        if self.caller is None:
            raise HostFunctionError(f"ctx.call({name!r}): handler {self.kind!r} declares no host functions")
        return self.caller(name, {} if args is None else args)

    def db(self) -> Any:
        """`with ctx.db() as conn:` (or `async with`): a connection to the
        application's database in a transaction scoped to this job's tenant
        and actor (docs/tenant-data.md). Raises NoAppDatabase where there is none."""
        if self.database is None and self.sandboxed:
            raise NoAppDatabase("ctx.db(): sandboxed code never gets a database connection, whatever the "
                                "worker's --app-db: read the tenant's data through a host function "
                                "(docs/tenant-data.md), or run this handler inline")
        if self.database is None:
            raise NoAppDatabase("ctx.db(): this worker has no application database (set "
                                "TENANTQ_APP_DATABASE_URL or start it with --app-db URL); sandboxed "
                                "code never gets a database connection")
        from tenantq.tenant_data import TenantDb

        return TenantDb(self.database, self.tenant, self.actor)


HandlerFunc = Callable[[Any, JobContext], Any]
F = TypeVar("F", bound=HandlerFunc)


@dataclass(frozen=True)
class Handler:
    kind: str
    func: HandlerFunc
    timeout: float
    memory_mb: int
    isolation: Isolation
    # refuse to run in the dispatcher process even on an inline worker
    sandbox_only: bool = False
    # "module:function" that prepares what this handler needs (imports, a
    # loaded model); run once per sandbox parent, so templates capture it
    warmup: str | None = None
    # narrows the tenant's egress rules while this handler runs (never widens)
    egress: tuple[Rule, ...] | None = None
    process: Process = "job"
    # the host functions its jobs may call (ctx.call), never others
    host_functions: tuple[str, ...] = ()

    def call(self, payload: Any, ctx: JobContext) -> Any:
        """Run the handler: an `async def` one on an event loop of its own
        (asyncio.run: a fresh loop per job, closed after it, so nothing
        bound to one job's loop leaks into the next). asyncio is imported
        here, not at the top: it is 40% of `import tenantq`, which every job
        runner in a sandbox pays at its start."""
        import asyncio

        if inspect.iscoroutinefunction(self.func):
            return asyncio.run(self.func(payload, ctx))
        result = self.func(payload, ctx)
        if inspect.iscoroutine(result):  # a callable object whose __call__ is async
            return asyncio.run(result)
        return result


@dataclass(frozen=True)
class Periodic:
    """`@tenantq.periodic`: run a handler on a cron schedule, for some tenants."""

    func: HandlerFunc
    cron: str
    tenants: tuple[str, ...]
    payload: Any
    timezone: str
    priority: str
    max_attempts: int


class Registry:
    """Kind -> handler. The module-level REGISTRY is what `handler` fills."""

    def __init__(self) -> None:
        self._handlers: dict[str, Handler] = {}
        self._periodics: list[Periodic] = []
        # warmup name -> the function when registered by decorator (None:
        # resolve "module:function" on first use), in registration order
        self._warmups: dict[str, Callable[[], Any] | None] = {}
        # name -> tenantq.host_functions.HostFunction
        self._host_functions: dict[str, Any] = {}

    def add_host_function(self, function: Any) -> None:
        existing = self._host_functions.get(function.name)
        if existing is not None and existing.func is not function.func:
            raise InvalidInput(f"host function {function.name!r} is already registered "
                               f"({_name(existing.func)})")
        self._host_functions[function.name] = function

    def host_function(self, name: str) -> Any:
        return self._host_functions.get(name)

    def add(self, handler: Handler) -> None:
        existing = self._handlers.get(handler.kind)
        if existing is not None and existing.func is not handler.func:
            raise InvalidInput(f"kind {handler.kind!r} already has a handler ({_name(existing.func)})")
        self._handlers[handler.kind] = handler
        if handler.warmup is not None:
            self._warmups.setdefault(handler.warmup, None)

    def add_warmup(self, name: str, func: Callable[[], Any] | None = None) -> None:
        self._warmups[name] = func

    def warmups(self, kinds: list[str] | None = None) -> list[str]:
        """Warmup names in registration order: app-level ones plus those of
        the given kinds' handlers (all handlers when `kinds` is None)."""
        if kinds is None:
            return list(self._warmups)
        wanted = {h.warmup for k in kinds if (h := self._handlers.get(k)) is not None and h.warmup}
        per_handler = {h.warmup for h in self._handlers.values() if h.warmup}
        return [n for n in self._warmups if n in wanted or n not in per_handler]

    def resolve_warmup(self, name: str) -> Callable[[], Any]:
        func = self._warmups.get(name)
        if func is not None:
            return func
        module, _, attr = name.partition(":")
        try:
            target = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as exc:
            raise InvalidInput(f"warmup {name!r}: {exc}") from None
        if not callable(target):
            raise InvalidInput(f"warmup {name!r} is not callable")
        return target  # type: ignore[no-any-return]

    def add_periodic(self, declared: Periodic) -> None:
        self._periodics.append(declared)

    def periodic_schedules(self) -> list[Any]:
        """The app's declared schedules (domain.schedules.ScheduleSpec), one per
        tenant; a @periodic function that is no handler is an InvalidInput."""
        from tenantq.domain.schedules import spec

        kinds = {id(h.func): h.kind for h in self._handlers.values()}
        out: list[Any] = []
        for declared in self._periodics:
            kind = kinds.get(id(declared.func))
            if kind is None:
                raise InvalidInput(f"@tenantq.periodic on {_name(declared.func)}: it is not a handler; "
                                   "decorate it with @tenantq.handler(KIND) too")
            out.extend(spec(tenant, kind, declared.cron, payload=declared.payload, timezone=declared.timezone,
                            priority=declared.priority, max_attempts=declared.max_attempts, origin="app")
                       for tenant in declared.tenants)
        return out

    def get(self, kind: str) -> Handler | None:
        return self._handlers.get(kind)

    def kinds(self) -> list[str]:
        return sorted(self._handlers)

    def __contains__(self, kind: object) -> bool:
        return kind in self._handlers


REGISTRY = Registry()


def handler(
    kind: str,
    *,
    timeout: float = 60,
    memory_mb: int = 256,
    isolation: Isolation = "sandbox",
    sandbox_only: bool = False,
    warmup: str | None = None,
    egress: list[str] | None = None,
    process: Process = "job",
    host_functions: list[str] | None = None,
    registry: Registry | None = None,
) -> Callable[[F], F]:
    """Register `func(payload, ctx)` as the handler of `kind` (a plain
    function, or an `async def` one, run on an event loop of its own).

    `isolation="inline"` marks a trusted first-party kind that may run in
    the dispatcher process; everything else runs sandboxed when the worker
    has a sandbox driver. `warmup="module:function"` names code that imports
    and prepares what the handler needs; it runs once per sandbox parent
    (and is baked into the template snapshot), not once per job.
    `egress=["api.stripe.com"]` narrows what the tenant's egress rules allow
    while this handler runs; it can never allow more than the tenant's rules.
    `process="batch"` lets consecutive jobs of this kind in one sandboxed
    batch share one process (no fork per job: much faster under gVisor),
    trusting that one job's code does not tamper with the next ones of the
    same kind in its batch; the default, "job", gives every job a fresh one.
    `host_functions=["orders.for_month"]`: the host functions
    (`@tenantq.host_function`) its jobs may call with `ctx.call`.
    """
    validation.kind(kind)
    if timeout <= 0:
        raise InvalidInput(f"handler {kind!r}: timeout must be positive, got {timeout}")
    if memory_mb < 16:
        raise InvalidInput(f"handler {kind!r}: memory_mb must be at least 16, got {memory_mb}")
    if isolation not in ("sandbox", "inline"):
        raise InvalidInput(f"handler {kind!r}: isolation must be 'sandbox' or 'inline'")
    if process not in ("job", "batch"):
        raise InvalidInput(f"handler {kind!r}: process must be 'job' or 'batch', got {process!r}")
    if warmup is not None and not _is_warmup_name(warmup):
        raise InvalidInput(f"handler {kind!r}: warmup must be 'module:function', got {warmup!r}")

    narrowed = None if egress is None else parse_rules(egress)
    callable_names = tuple(dict.fromkeys(host_functions or ()))
    for name in callable_names:
        validation.kind(name, "host function name")

    def register(func: F) -> F:
        (registry or REGISTRY).add(Handler(kind, func, float(timeout), memory_mb, isolation, sandbox_only,
                                           warmup, narrowed, process, callable_names))
        return func

    return register


def periodic(
    cron: str,
    *,
    tenant: str | list[str] | tuple[str, ...],
    payload: Any = None,
    timezone: str = "UTC",
    priority: str = "default",
    max_attempts: int = 5,
    registry: Registry | None = None,
) -> Callable[[F], F]:
    """Enqueue a job of this handler on a cron schedule (`"*/5 * * * *"`,
    `"@daily"`), in `timezone`, for one tenant or a list of them. Stack it
    on `@tenantq.handler(KIND)`. Every worker that loads the app keeps the
    schedules in step (docs/periodic.md); one job per fire time, however
    many workers run."""
    from tenantq.domain.cron import cron_expression, time_zone

    expression, zone = cron_expression(cron), time_zone(timezone)
    tenants = (tenant,) if isinstance(tenant, str) else tuple(tenant)
    if not tenants:
        raise InvalidInput("@tenantq.periodic needs at least one tenant")
    for one in tenants:
        validation.tenant_id(one)
    validation.payload_object(payload)
    validation.payload_json({} if payload is None else payload)
    validation.priority(priority)
    validation.max_attempts(max_attempts)

    def register(func: F) -> F:
        (registry or REGISTRY).add_periodic(Periodic(func, expression, tenants, payload, zone, priority,
                                                     max_attempts))
        return func

    return register


W = TypeVar("W", bound=Callable[[], Any])


def warmup(func: W) -> W:
    """App-level warmup: `@tenantq.warmup` on a no-argument function that
    imports and prepares what every handler needs. It runs once in each
    sandbox parent before any batch (and in the template snapshot)."""
    REGISTRY.add_warmup(f"{func.__module__}:{func.__qualname__}", func)
    return func


def _is_warmup_name(name: str) -> bool:
    module, sep, attr = name.partition(":")
    return bool(sep and module and attr.isidentifier()
                and all(part.isidentifier() for part in module.split(".")))


def load_app(app: str) -> str:
    """Import the app module that registers handlers; returns its dotted name.

    `app` is a dotted module importable from the current directory or
    PYTHONPATH (`myapp.jobs`); the current directory is put on sys.path
    first, as `python -m` would. Also accepted: a file (`myapp/jobs.py`),
    named from the top of its package (the nearest parent without an
    `__init__.py`, which is put on sys.path), and `module:attr`
    (`myapp.jobs:app`), which imports the module. Every failure is an
    InvalidInput of one line: the error's first line and the app's file:line.
    """
    cwd = str(Path.cwd())
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    module = _app_module(app)
    try:
        importlib.import_module(module)
    except SyntaxError as exc:  # IndentationError too: the app's own file and line
        where = f" ({_shown(exc.filename)}:{exc.lineno})" if exc.filename else ""
        raise InvalidInput(f"cannot import the app {module}: {type(exc).__name__}: {exc.msg}{where}"
                           ) from None
    except Exception as exc:
        raise InvalidInput(_import_failure(module, exc)) from None
    if module != "tenantq.builtins" and not any(
            (h := REGISTRY.get(k)) is not None and getattr(h.func, "__module__", "") != "tenantq.builtins"
            for k in REGISTRY.kinds()):
        raise InvalidInput(f"the app {module} registers no handler: "
                           "decorate functions with @tenantq.handler(KIND)")
    return module


_APP_FORMS = ("--app takes a dotted module importable from the current directory or PYTHONPATH, "
              "e.g. myapp.jobs, or the path of a .py file")


def _app_module(app: str) -> str:
    """`myapp.jobs`, `myapp.jobs:attr`, `myapp/jobs.py` or `myapp/` -> the module to import."""
    spec = app.strip().split(":", 1)[0]  # module:attr -> the module
    if not spec:
        raise InvalidInput(f"--app {app!r} names no module ({_APP_FORMS})")
    if "/" not in spec and os.sep not in spec and not spec.endswith(".py"):
        if not all(part.isidentifier() for part in spec.split(".")):
            raise InvalidInput(f"--app {app!r} is not a module name ({_APP_FORMS})")
        return spec
    path = Path(spec)
    if path.is_dir() and (path / "__init__.py").is_file():
        path = path / "__init__.py"
    elif path.suffix != ".py" and path.with_name(path.name + ".py").is_file():
        path = path.with_name(path.name + ".py")  # myapp/jobs
    if not path.is_file() or path.suffix != ".py":
        # myapp.jobs.py: the module myapp.jobs, written as a file name
        guess = spec.removesuffix(".py").strip("/").replace("/", ".")
        parts = guess.split(".")
        exists = all(p.isidentifier() for p in parts) and (
            Path(*parts).with_suffix(".py").is_file() or (Path(*parts) / "__init__.py").is_file())
        if exists:
            return guess
        raise InvalidInput(f"--app {app}: no such file ({_APP_FORMS})")
    path = path.resolve()
    parts = [] if path.stem == "__init__" else [path.stem]
    root = path.parent
    while (root / "__init__.py").is_file() and root.parent != root:
        parts.insert(0, root.name)
        root = root.parent
    bad = [p for p in parts if not p.isidentifier()]
    if not parts or bad:
        raise InvalidInput(f"--app {app}: {(bad or [path.stem])[0]!r} cannot be a module name "
                           f"(rename it to letters, digits and _; {_APP_FORMS})")
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    return ".".join(parts)


def _import_failure(module: str, exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    missing = getattr(exc, "name", None) if isinstance(exc, ModuleNotFoundError) else None
    if missing and (module == missing or module.startswith(missing + ".")):
        # the app itself is not found, not something it imports
        return (f"cannot import the app {module}: {first or 'not found'} ({_APP_FORMS}; "
                f"the current directory is {Path.cwd()})")
    frame = _app_frame(exc)
    where = f" ({_shown(frame.filename)}:{frame.lineno})" if frame else ""
    label = first if isinstance(exc, (ImportError, TenantqError)) else f"{type(exc).__name__}: {first}"
    return f"cannot import the app {module}: {label.rstrip(': ')}{where}"


def _app_frame(exc: BaseException) -> traceback.FrameSummary | None:
    """The innermost frame of the app's own code (not the import machinery,
    tenantq, the standard library or installed packages), else the innermost
    real file."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith("<")]
    paths = sysconfig.get_paths()
    skip = {str(Path(__file__).resolve().parent),
            *(os.path.realpath(paths[k]) for k in ("stdlib", "platstdlib") if k in paths)}

    def app_code(f: traceback.FrameSummary) -> bool:
        real = os.path.realpath(f.filename)
        installed = {"site-packages", "dist-packages"} & set(Path(real).parts)
        return not installed and not any(real.startswith(d + os.sep) for d in skip)

    own = [f for f in frames if app_code(f)]
    chosen = own or frames
    return chosen[-1] if chosen else None


def _shown(filename: str) -> str:
    """A path relative to the current directory when it is under it."""
    try:
        return str(Path(filename).resolve().relative_to(Path.cwd()))
    except ValueError:
        return filename


def _name(func: Callable[..., Any]) -> str:
    return f"{getattr(func, '__module__', '?')}.{getattr(func, '__qualname__', '?')}"
