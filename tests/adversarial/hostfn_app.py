"""Host functions and a hostile tenant's handlers that call them
(tests/adversarial/test_host_functions.py), written from docs/security.md
(rule F1), docs/tenant-data.md and the guest-visible code only.

The handlers run in the sandbox (stdlib only); the host functions run in the
dispatcher, so their own imports (psycopg) happen only when they run. Every
host function appends one line per run to TQ_ADV_HOSTFN_LOG (the host's own
record of what ran, for which job, tenant and actor), which is how the test
tells what the host executed whatever the guest saw. Every call a guest makes
carries a tag "<its ctx.job_id>:<label>", so a call that runs for another job
than the one that made it shows.

The app schema is TQ_ADV_APP_SCHEMA in the worker's environment.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import tenantq
from tenantq.guest.jobs import HOST_FUNCTIONS_SOCKET
from tests.adversarial import attack_app  # noqa: F401  (adv.echo, the neighbour's honest job)

LOG_ENV = "TQ_ADV_HOSTFN_LOG"
SCHEMA_ENV = "TQ_ADV_APP_SCHEMA"
HEADER = 11
BIG_RESULT_CHARS = 900_000
OVERRUN_SECONDS = 3.0
# mal.daemon's requests at its end: per thread, and how many before it returns
LATE_PER_THREAD = 70
LATE_BEFORE_RETURN = 150
# what each handler declares (the test checks every host-side run against it)
DECLARED: dict[str, list[str]] = {
    "mal.peer": ["mal.other", "mal.log"],
    "mal.raw": ["mal.noop", "mal.echo", "mal.log", "mal.big", "mal.whoami", "mal.hold"],
    "mal.confuse": ["mal.whoami", "mal.switch", "mal.insert", "mal.log", "mal.overrun", "mal.noop"],
    "mal.daemon": ["mal.log"],
    "mal.after": ["mal.log", "mal.noop"],
    "mal.flood": ["mal.noop", "mal.hold"],
    "mal.uncaught": ["mal.noop"],
    "mal.honest": ["mal.whoami", "mal.log"],
}

# -- the host functions (they run in the dispatcher) ------------------------------------

_lock = threading.Lock()


def _record(ctx: tenantq.HostContext, fn: str, args: Any, phase: str = "run", call: str = "") -> None:
    path = os.environ.get(LOG_ENV)
    if not path:
        return
    try:
        text = json.dumps(args)[:300]
    except (TypeError, ValueError, RecursionError) as exc:
        text = f"(not dumpable: {type(exc).__name__})"
    tag = args.get("tag") if isinstance(args, dict) else None
    line = json.dumps({"fn": fn, "tenant": ctx.tenant, "actor": ctx.actor, "job_id": ctx.job_id,
                       "kind": ctx.kind, "tag": tag if isinstance(tag, str) else None, "args": text,
                       "phase": phase, "call": call, "t": time.time()})
    with _lock, open(path, "a") as fh:
        fh.write(line + "\n")


def _me(ctx: tenantq.HostContext) -> dict[str, Any]:
    return {"tenant": ctx.tenant, "actor": ctx.actor, "job_id": ctx.job_id, "kind": ctx.kind}


def _table() -> Any:
    from psycopg import sql

    return sql.Identifier(os.environ[SCHEMA_ENV], "orders")


@tenantq.host_function("mal.log")
def log(args: dict[str, Any], ctx: tenantq.HostContext) -> dict[str, Any]:
    _record(ctx, "mal.log", args)
    return _me(ctx)


@tenantq.host_function("mal.noop")
def noop(args: dict[str, Any], ctx: tenantq.HostContext) -> int:
    _record(ctx, "mal.noop", args)
    return 1


@tenantq.host_function("mal.echo")
def echo(args: dict[str, Any], ctx: tenantq.HostContext) -> Any:
    _record(ctx, "mal.echo", args)
    return args


@tenantq.host_function("mal.big")
def big(args: dict[str, Any], ctx: tenantq.HostContext) -> str:
    _record(ctx, "mal.big", args)
    return "x" * BIG_RESULT_CHARS


@tenantq.host_function("mal.hold")
def hold(args: dict[str, Any], ctx: tenantq.HostContext) -> int:
    """Short enough to be answered, long enough to see how many run at once."""
    call = uuid.uuid4().hex
    _record(ctx, "mal.hold", args, "start", call)
    time.sleep(0.05)
    _record(ctx, "mal.hold", args, "end", call)
    return 1


@tenantq.host_function("mal.overrun", timeout=0.5)
def overrun(args: dict[str, Any], ctx: tenantq.HostContext) -> None:
    """Runs on past its timeout: counts as in flight until it returns."""
    call = uuid.uuid4().hex
    _record(ctx, "mal.overrun", args, "start", call)
    time.sleep(OVERRUN_SECONDS)
    _record(ctx, "mal.overrun", args, "end", call)


@tenantq.host_function("mal.whoami")
def whoami(args: dict[str, Any], ctx: tenantq.HostContext) -> dict[str, Any]:
    """An app function that takes row ids and a tenant from its args (the
    mistakes RLS guards against): every bound as data, never SQL."""
    from psycopg import sql

    _record(ctx, "mal.whoami", args)
    ids = [i for i in args.get("ids", []) if isinstance(i, int) and not isinstance(i, bool)]
    named = str(args.get("tenant"))
    fragment = str(args.get("sql"))
    with ctx.db() as conn:
        setting = conn.execute("SELECT current_setting('app.current_tenant_id', true)").fetchone()
        actor = conn.execute("SELECT current_setting('app.current_actor', true)").fetchone()
        rows = conn.execute(sql.SQL("SELECT id, tenant_id FROM {} ORDER BY id").format(_table())).fetchall()
        by_id = conn.execute(sql.SQL("SELECT id FROM {} WHERE id = ANY(%s) ORDER BY id").format(_table()),
                             (ids,)).fetchall()
        by_tenant = conn.execute(sql.SQL("SELECT id FROM {} WHERE tenant_id = %s OR tenant_id = %s "
                                         "ORDER BY id").format(_table()), (named, fragment)).fetchall()
    return {**_me(ctx), "setting": setting[0] if setting else None, "db_actor": actor[0] if actor else None,
            "rows": [[r[0], r[1]] for r in rows], "by_id": [r[0] for r in by_id],
            "by_tenant": [r[0] for r in by_tenant]}


@tenantq.host_function("mal.switch")
def switch(args: dict[str, Any], ctx: tenantq.HostContext) -> bool:
    """Sets another tenant (and actor) on its session, not just its transaction."""
    _record(ctx, "mal.switch", args)
    with ctx.db() as conn:
        conn.execute("SELECT set_config('app.current_tenant_id', %s, false), "
                     "set_config('app.current_actor', %s, false)",
                     (str(args.get("tenant")), str(args.get("actor"))))
    return True


@tenantq.host_function("mal.insert")
def insert(args: dict[str, Any], ctx: tenantq.HostContext) -> bool:
    """Writes the tenant id its args name: RLS must refuse another tenant's."""
    from psycopg import sql

    _record(ctx, "mal.insert", args)
    with ctx.db() as conn:
        conn.execute(sql.SQL("INSERT INTO {} VALUES (%s, %s, 1)").format(_table()),
                     (int(args["id"]), str(args["tenant"])))
    return True


@tenantq.host_function("mal.other")
def other(args: dict[str, Any], ctx: tenantq.HostContext) -> str:
    """Declared by mal.peer only."""
    _record(ctx, "mal.other", args)
    return "other"


@tenantq.host_function("mal.secret_all")
def secret_all(args: dict[str, Any], ctx: tenantq.HostContext) -> str:
    """Registered, declared by no handler."""
    _record(ctx, "mal.secret_all", args)
    return "every tenant's orders"


# -- in the sandbox: raw traffic on the socket ------------------------------------------


def frame(body: bytes) -> bytes:
    return b"%010d\n" % len(body) + body


def request(name: Any, args: Any, **extra: Any) -> bytes:
    return frame(json.dumps({"name": name, "args": args, **extra}).encode())


def _connect(timeout: float = 5.0) -> socket.socket:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(timeout)
    conn.connect(HOST_FUNCTIONS_SOCKET)
    return conn


def _summary(reply: Any) -> Any:
    if not isinstance(reply, dict):
        return {"not_an_object": repr(reply)[:200]}
    out: dict[str, Any] = {"ok": reply.get("ok")}
    if "error" in reply:
        out["error"] = str(reply["error"])[:400]
    if "result" in reply:
        text = json.dumps(reply["result"])
        out["result"] = reply["result"] if len(text) < 400 else f"({len(text)} bytes)"
    return out


def read_reply(conn: socket.socket, wait: float) -> dict[str, Any]:
    """What came back within `wait` s: a parsed reply, EOF, or nothing."""
    t0 = time.monotonic()
    deadline = t0 + wait
    buf = bytearray()
    out: dict[str, Any] = {}
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            out["timeout"] = True
            break
        conn.settimeout(remaining)
        try:
            chunk = conn.recv(1 << 16)
        except TimeoutError:
            out["timeout"] = True
            break
        except OSError as exc:
            out["recv_error"] = f"{type(exc).__name__}: {exc}"[:200]
            break
        if not chunk:
            out["eof"] = True
            break
        buf += chunk
        if len(buf) >= HEADER and buf[:10].isdigit() and len(buf) >= HEADER + int(buf[:10]):
            break
        if len(buf) > (2 << 20):
            out["overlong"] = True
            break
    out["secs"] = round(time.monotonic() - t0, 3)
    out["bytes"] = len(buf)
    if buf:
        if len(buf) >= HEADER and buf[:10].isdigit() and buf[10:11] == b"\n":
            body = bytes(buf[HEADER:HEADER + int(buf[:10])])
            try:
                out["reply"] = _summary(json.loads(body))
            except ValueError:
                out["raw"] = repr(body[:200])
        else:
            out["raw"] = repr(bytes(buf[:200]))
    return out


def exchange(data: bytes, *, wait: float = 2.5, shut: bool = False) -> dict[str, Any]:
    """One connection: send `data` (in a thread: the host may stop reading),
    optionally half-close, and read what comes back."""
    try:
        conn = _connect()
    except OSError as exc:
        return {"connect_error": f"{type(exc).__name__}: {exc}"[:200]}
    sent: dict[str, Any] = {}

    def send() -> None:
        try:
            conn.sendall(data)
            if shut:
                conn.shutdown(socket.SHUT_WR)
        except OSError as exc:
            sent["send_error"] = f"{type(exc).__name__}: {exc}"[:200]

    sender = threading.Thread(target=send, daemon=True)
    with conn:
        sender.start()
        out = read_reply(conn, wait)
    sender.join(5)
    return {**out, **sent}


def _deep(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def raw_cases(me: int) -> dict[str, bytes]:
    """label -> the bytes one connection sends (tag: which job, which case)."""
    def tag(label: str) -> dict[str, str]:
        return {"tag": f"{me}:raw:{label}"}

    def body(label: str, text: str) -> bytes:
        return frame(text.replace("TAG", json.dumps(tag(label))[1:-1]).encode())

    noop_args = json.dumps(tag("noop"))
    cases: dict[str, bytes] = {
        "bad_header_text": b"hello, host\n{}",
        "bad_header_sign": b"-000000002\n{}",
        "bad_header_space": b" 000000002\n{}",
        "bad_header_no_newline": b"0000000002X{}",
        "bad_header_hex": b"0x0000000a\n" + b'{"a": "b"}',
        "header_10gb": b"9999999999\n",
        "header_64k_plus_1": b"0000065537\n",
        "garbage_json": frame(b'{"name": "mal.noop", "args": {'),
        "not_utf8": frame(b'{"name": "mal.noop\xff\xfe", "args": ' + noop_args.encode() + b"}"),
        "nan": body("nan", '{"name": "mal.echo", "args": {TAG, "x": NaN}}'),
        "infinity": body("infinity", '{"name": "mal.echo", "args": {TAG, "x": -Infinity}}'),
        "float_overflow": body("float_overflow", '{"name": "mal.echo", "args": {TAG, "x": 1e400}}'),
        "deep_args": frame(b'{"name": "mal.echo", "args": {"a": ' + _deep(30000) + b"}}"),
        "deep_body": frame(_deep(32000)),
        "args_list": request("mal.noop", [1, 2]),
        "args_string": request("mal.noop", "tag"),
        "args_null": request("mal.noop", None),
        "args_number": request("mal.noop", 42),
        "args_true": request("mal.noop", True),
        "args_missing": frame(b'{"name": "mal.noop"}'),
        "body_list": frame(b'["mal.noop", {}]'),
        "body_string": frame(b'"mal.noop"'),
        "body_empty": frame(b""),
        "body_empty_object": frame(b"{}"),
        "name_huge": request("mal.noop" + "x" * 60000, tag("name_huge")),
        "name_int": request(123, tag("name_int")),
        "name_null": request(None, tag("name_null")),
        "name_list": request(["mal.noop"], tag("name_list")),
        "name_object": request({"mal.noop": 1}, tag("name_object")),
        "name_zero_width": request("mal.noop\u200b", tag("name_zero_width")),
        "name_fullwidth": request("\uff4d\uff41\uff4c.\uff4e\uff4f\uff4f\uff50", tag("name_fullwidth")),
        "name_upper": request("MAL.NOOP", tag("name_upper")),
        "name_newline": request("mal.noop\n", tag("name_newline")),
        "name_nul": request("mal.noop\x00", tag("name_nul")),
        "name_surrogate": frame(b'{"name": "mal.noop\\udc80", "args": ' + json.dumps(
            tag("name_surrogate")).encode() + b"}"),
        "name_cyrillic": request("m\u0430l.noop", tag("name_cyrillic")),
        "name_combining": request("mal.noop\u0301", tag("name_combining")),
        "name_rtl": request("\u202emal.noop", tag("name_rtl")),
        "name_space": request("mal.noop ", tag("name_space")),
        "name_prefix": request("mal.noo", tag("name_prefix")),
        "undeclared_peer": request("mal.other", tag("undeclared_peer")),
        "registered_undeclared": request("mal.secret_all", tag("registered_undeclared")),
        "unknown": request("mal.nothing", tag("unknown")),
        "dup_name": frame(b'{"name": "mal.noop", "name": "mal.other", "args": '
                          + json.dumps(tag("dup_name")).encode() + b"}"),
        "forged_envelope": request("mal.whoami", {**tag("forged_envelope"), "tenant": "acme"}, tenant="acme",
                                   actor="root", job_id=1, kind="mal.honest", tenant_id="acme"),
        "trailing_bytes": request("mal.noop", tag("trailing_bytes")) + b"GARBAGE" * 100,
        "two_requests": request("mal.noop", tag("two_requests_1"))
        + request("mal.noop", tag("two_requests_2")),
    }
    return cases


def raw_attacks(me: int) -> dict[str, Any]:
    """Everything a job can do to the socket itself; one report."""
    report: dict[str, Any] = {}
    held: dict[str, Any] = {}

    def slowloris(label: str, data: bytes, gap: float) -> None:
        try:
            conn = _connect()
        except OSError as exc:
            held[label] = {"connect_error": str(exc)[:200]}
            return
        with conn:
            try:
                for i in range(len(data)):
                    conn.sendall(data[i:i + 1])
                    time.sleep(gap)
            except OSError as exc:
                held[label] = {"send_error": f"{type(exc).__name__}: {exc}"[:200]}
                return
            held[label] = read_reply(conn, 14.0)  # from the last byte: the host's 10 s deadline

    def never_read(label: str, name: str) -> None:
        try:
            conn = _connect()
            conn.sendall(request(name, {"tag": f"{me}:raw:{label}"}))
        except OSError as exc:
            held[label] = {"error": str(exc)[:200]}
            return
        with conn:
            time.sleep(12.0)
            try:
                peek = conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
                held[label] = {"after_12s": "data" if peek else "eof"}
            except BlockingIOError:
                held[label] = {"after_12s": "nothing"}
            except OSError as exc:
                held[label] = {"after_12s": f"{type(exc).__name__}"}

    body_stall = b"0000000100\n" + b'{"name": "'
    phase1 = [threading.Thread(target=slowloris, args=("slowloris_header", b"000000", 0.1), daemon=True),
              threading.Thread(target=slowloris, args=("slowloris_body", body_stall, 0.05), daemon=True),
              threading.Thread(target=never_read, args=("never_read_big", "mal.big"), daemon=True),
              threading.Thread(target=never_read, args=("never_read_small", "mal.noop"), daemon=True)]
    t0 = time.monotonic()
    for thread in phase1:
        thread.start()
    # meanwhile, one request at a time (5 connections at most with the held ones)
    for label, data in raw_cases(me).items():
        report[label] = exchange(data)
    big_body = b"0010485760\n" + b"x" * (10 << 20)
    report["body_10mib"] = exchange(big_body, wait=5.0)
    report["half_close_after_request"] = exchange(request("mal.noop", {"tag": f"{me}:raw:half_close"}),
                                                  shut=True)
    report["half_close_mid_header"] = exchange(b"00000", shut=True)
    report["half_close_mid_body"] = exchange(b"0000000100\n" + b'{"name"', shut=True)
    for thread in phase1:
        thread.join(30)
    report.update(held)
    report["phase1_secs"] = round(time.monotonic() - t0, 2)
    report["parallel"] = parallel_connections(me)
    report["parallel_calls"] = parallel_calls(me)
    report["socket_path"] = replace_socket(me)
    return report


def parallel_connections(me: int, count: int = 300) -> dict[str, Any]:
    """Hundreds of idle connections at once: the host keeps at most
    in-flight + 4 open; once they are closed, calls work again."""
    conns: list[socket.socket] = []
    errors: dict[str, int] = {}
    for _ in range(count):
        try:
            conns.append(_connect(2.0))
        except OSError as exc:
            errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
    time.sleep(1.5)
    states: dict[str, int] = {}
    for conn in conns:
        conn.setblocking(False)
        try:
            state = "answered" if conn.recv(1) else "closed"
        except BlockingIOError:
            state = "open"
        except OSError as exc:
            state = f"closed ({type(exc).__name__})"
        states[state] = states.get(state, 0) + 1
    during = exchange(request("mal.noop", {"tag": f"{me}:raw:during_parallel"}))
    for conn in conns:
        conn.close()
    after: dict[str, Any] = {}
    for _ in range(10):
        time.sleep(0.3)
        after = exchange(request("mal.noop", {"tag": f"{me}:raw:after_parallel"}))
        if after.get("reply", {}).get("ok") is True:
            break
    return {"connected": len(conns), "connect_errors": errors, "states": states,
            "still_open": states.get("open", 0), "call_during": during, "call_after": after}


def parallel_calls(me: int, count: int = 100) -> dict[str, Any]:
    """A hundred requests at once on their own connections: at most 4 run at
    a time (the host's log shows it), every other one is refused or closed."""
    conns: list[socket.socket] = []
    for i in range(count):
        try:
            conn = _connect(2.0)
            conn.sendall(request("mal.hold", {"tag": f"{me}:raw:parallel_call_{i}"}))
            conns.append(conn)
        except OSError:
            pass
    outcomes: dict[str, int] = {}
    for conn in conns:
        with conn:
            out = read_reply(conn, 12.0)
        reply = out.get("reply")
        if isinstance(reply, dict):
            key = "ok" if reply.get("ok") is True else "refused: " + str(reply.get("error"))[:60]
        elif out.get("eof") or "ConnectionReset" in str(out.get("recv_error")):
            key = "closed"
        else:
            key = "timeout" if out.get("timeout") else f"other: {out}"[:120]
        outcomes[key] = outcomes.get(key, 0) + 1
    return {"sent": len(conns), "outcomes": outcomes}


def _try(func: Callable[[], object]) -> str:
    try:
        func()
    except OSError as exc:
        return f"refused: {exc.strerror or exc}"
    return "DONE"


def replace_socket(me: int) -> dict[str, Any]:
    """The socket's directory is read-only for the guest: the job can
    neither unlink, rename, chmod nor replace the socket or add a file there."""
    path = HOST_FUNCTIONS_SOCKET
    where = os.path.dirname(path)
    evil = os.path.join(where, "evil.sock")

    def bind_own() -> None:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.bind(evil)

    def bind_over() -> None:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.bind(path)

    def write_file() -> None:
        with open(os.path.join(where, "planted"), "w") as fh:
            fh.write("x")

    attempts = {
        "unlink": lambda: os.unlink(path),
        "rename": lambda: os.rename(path, path + ".moved"),
        "chmod": lambda: os.chmod(path, 0o777),
        "utime": lambda: os.utime(path),
        "symlink": lambda: os.symlink("/tmp/x.sock", os.path.join(where, "link.sock")),
        "mkdir": lambda: os.mkdir(os.path.join(where, "dir")),
        "create_file": write_file,
        "bind_new": bind_own,
        "bind_over": bind_over,
        "rmdir_parent": lambda: os.rmdir(where),
    }
    out: dict[str, Any] = {name: _try(func) for name, func in attempts.items()}
    out["listing"] = sorted(os.listdir(where))[:20]
    out["call_after"] = exchange(request("mal.noop", {"tag": f"{me}:raw:after_socket_attacks"}))
    return out


# -- the handlers (in the sandbox) ------------------------------------------------------


def socket_stamp() -> str:
    """Which batch's socket this job sees (bound anew per batch)."""
    try:
        st = os.stat(HOST_FUNCTIONS_SOCKET)
    except OSError as exc:
        return f"no socket: {exc}"
    return f"{st.st_ino}:{st.st_mtime_ns}:{st.st_ctime_ns}"


def attempt(ctx: tenantq.JobContext, name: str, args: Any) -> dict[str, Any]:
    try:
        return {"ok": ctx.call(name, args)}
    except tenantq.HostFunctionError as exc:
        return {"error": str(exc)[:400]}
    except Exception as exc:  # anything else is a broken promise: reported
        return {"other_exception": f"{type(exc).__name__}: {exc}"[:400]}


def _tag(ctx: tenantq.JobContext, label: str, **more: Any) -> dict[str, Any]:
    return {"tag": f"{ctx.job_id}:{label}", **more}


@tenantq.handler("mal.peer", host_functions=DECLARED["mal.peer"], timeout=30)
def peer(payload: Any, ctx: tenantq.JobContext) -> dict[str, Any]:
    return {"stamp": socket_stamp(), "other": attempt(ctx, "mal.other", _tag(ctx, "other")),
            "log": attempt(ctx, "mal.log", _tag(ctx, "log")),
            # declared by mal.raw, the next job in this batch
            "noop_of_sibling": attempt(ctx, "mal.noop", _tag(ctx, "noop_of_sibling"))}


@tenantq.handler("mal.raw", host_functions=DECLARED["mal.raw"], timeout=100, memory_mb=1024)
def raw(payload: Any, ctx: tenantq.JobContext) -> dict[str, Any]:
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # the host hangs up on what it refuses
    stamp = socket_stamp()
    report = raw_attacks(ctx.job_id)
    report["stamp"] = stamp
    report["other_via_ctx"] = attempt(ctx, "mal.other", _tag(ctx, "other_via_ctx"))
    report["log_at_end"] = attempt(ctx, "mal.log", _tag(ctx, "log_at_end"))
    return report


HOSTILE_ARGS: dict[str, Any] = {
    "tenant": "acme", "tenant_id": "acme", "actor": "root", "job_id": 1, "kind": "mal.honest",
    "ids": [1, 2, 3, 10, 11, 20, 21], "sql": "x' OR '1'='1", "where": "true) OR (true",
}


@tenantq.handler("mal.confuse", host_functions=DECLARED["mal.confuse"], timeout=60, memory_mb=768)
def confuse(payload: Any, ctx: tenantq.JobContext) -> dict[str, Any]:
    out: dict[str, Any] = {"stamp": socket_stamp(),
                           "whoami": attempt(ctx, "mal.whoami", _tag(ctx, "whoami", **HOSTILE_ARGS))}
    out["injection"] = attempt(ctx, "mal.whoami", _tag(ctx, "injection", tenant="mallory' OR '1'='1",
                                                       sql="acme'; SET app.current_tenant_id = 'acme"))
    out["switch"] = attempt(ctx, "mal.switch", _tag(ctx, "switch", tenant="acme", actor="root"))
    out["after_switch"] = [attempt(ctx, "mal.whoami", _tag(ctx, f"after_switch_{i}", tenant="acme"))
                           for i in range(3)]
    out["insert_other_tenant"] = attempt(ctx, "mal.insert", _tag(ctx, "insert", id=900, tenant="acme"))
    threaded: list[dict[str, Any]] = []

    def one(i: int) -> None:
        threaded.append(attempt(ctx, "mal.whoami", _tag(ctx, f"threaded_{i}", tenant="globex", ids=[10])))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    out["threaded"] = threaded
    # four calls that overrun: answered at their timeout, still in flight on the host
    overruns: list[dict[str, Any]] = []
    t0 = time.monotonic()

    def late(i: int) -> None:
        overruns.append({**attempt(ctx, "mal.overrun", _tag(ctx, f"overrun_{i}")),
                         "secs": round(time.monotonic() - t0, 2)})

    threads = [threading.Thread(target=late, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    out["overruns"] = overruns
    out["while_overrunning"] = attempt(ctx, "mal.noop", _tag(ctx, "while_overrunning"))
    out["while_overrunning_secs"] = round(time.monotonic() - t0, 2)
    time.sleep(max(0.0, OVERRUN_SECONDS + 0.7 - (time.monotonic() - t0)))
    out["after_overruns"] = attempt(ctx, "mal.noop", _tag(ctx, "after_overruns"))
    return out


def _fire(tag: str, name: str = "mal.log") -> None:
    """A complete request, then hang up without waiting for the answer."""
    with contextlib.suppress(OSError), _connect(1.0) as conn:
        conn.sendall(request(name, {"tag": tag}))


@tenantq.handler("mal.daemon", host_functions=DECLARED["mal.daemon"], timeout=30, memory_mb=768)
def daemon(payload: Any, ctx: tenantq.JobContext) -> dict[str, Any]:
    """Leaves a daemon that keeps calling (requests it hangs up on, and full
    calls), and as it returns completes requests it held back and fires more
    that it does not wait for, half of them for mal.noop, which it does not
    declare (the next job's handler does): none of them may ever run as the
    next job's."""
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    me = ctx.job_id
    pid = os.fork()
    if pid == 0:
        try:
            os.setsid()
            if os.fork() != 0:
                os._exit(0)
            for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
                signal.signal(signum, signal.SIG_IGN)
            end = time.monotonic() + 20
            n = 0
            while time.monotonic() < end:
                n += 1
                if n % 4:
                    _fire(f"{me}:daemon_fire_{n}")
                else:
                    with contextlib.suppress(Exception):
                        ctx.call("mal.log", {"tag": f"{me}:daemon_call_{n}"})
                time.sleep(0.01)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    time.sleep(0.3)
    # requests sent but for their last byte, completed at the last moment
    held: list[tuple[socket.socket, bytes]] = []
    for i in range(4):
        with contextlib.suppress(OSError):
            conn = _connect(1.0)
            data = request("mal.log", {"tag": f"{me}:held_{i}"})
            conn.sendall(data[:-1])
            held.append((conn, data[-1:]))
    time.sleep(0.2)
    for conn, last in held:
        with contextlib.suppress(OSError):
            conn.sendall(last)
    # and requests it hangs up on, from three threads, still firing as it returns
    fired = [0]

    def burst(t: int) -> None:
        for i in range(LATE_PER_THREAD):
            # every other one names mal.noop: declared by mal.after, not by this handler
            _fire(f"{me}:late_{t}_{i}", "mal.noop" if i % 2 else "mal.log")
            fired[0] += 1

    for t in range(3):
        threading.Thread(target=burst, args=(t,), daemon=True).start()
    deadline = time.monotonic() + 10
    while fired[0] < LATE_BEFORE_RETURN and time.monotonic() < deadline:
        time.sleep(0.001)
    return {"stamp": socket_stamp(), "held": len(held), "fired_before_return": fired[0]}


@tenantq.handler("mal.after", host_functions=DECLARED["mal.after"], timeout=30)
def after(payload: Any, ctx: tenantq.JobContext) -> dict[str, Any]:
    """The job after mal.daemon in its batch: its own calls must be its own."""
    seen = []
    for i in range(5):
        seen.append(attempt(ctx, "mal.log", _tag(ctx, f"after_{i}")))
        time.sleep(0.05)
    return {"stamp": socket_stamp(), "seen": seen}


@tenantq.handler("mal.flood", host_functions=DECLARED["mal.flood"], timeout=120, memory_mb=512)
def flood(payload: Any, ctx: tenantq.JobContext) -> dict[str, Any]:
    """Six forked children call at once (more than 4 in flight), each until
    the batch's 1,000 calls are spent (or 400 attempts)."""
    pipes: list[tuple[int, int]] = []
    for c in range(6):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            counts: dict[str, int] = {}
            spent = 0
            try:
                for i in range(400):
                    name = "mal.hold" if i < 15 else "mal.noop"
                    got = attempt(ctx, name, _tag(ctx, f"flood_{c}_{i}"))
                    key = "ok" if "ok" in got else (str(got.get("error") or got.get("other_exception")))[:90]
                    if "other_exception" in got:
                        key = "OTHER " + key
                    counts[key] = counts.get(key, 0) + 1
                    spent = spent + 1 if "error" in got and "already running" not in key else 0
                    if spent >= 3:
                        break
            finally:
                with contextlib.suppress(OSError):
                    os.write(w, json.dumps(counts).encode())
                os._exit(0)
        os.close(w)
        pipes.append((pid, r))
    total: dict[str, int] = {}
    for pid, r in pipes:
        chunks = []
        while chunk := os.read(r, 1 << 16):
            chunks.append(chunk)
        os.close(r)
        os.waitpid(pid, 0)
        with contextlib.suppress(ValueError):
            for key, n in json.loads(b"".join(chunks) or b"{}").items():
                total[key] = total.get(key, 0) + n
    return {"outcomes": total}


@tenantq.handler("mal.uncaught", host_functions=DECLARED["mal.uncaught"], timeout=30)
def uncaught(payload: Any, ctx: tenantq.JobContext) -> Any:
    """Lets the refusal end the job: a clear, classified error."""
    return ctx.call("mal.secret_all", _tag(ctx, "uncaught"))


@tenantq.handler("mal.honest", host_functions=DECLARED["mal.honest"], timeout=30)
def honest(payload: Any, ctx: tenantq.JobContext) -> dict[str, Any]:
    """The neighbour's own host-function job, running while the attack does."""
    return {"calls": [attempt(ctx, "mal.whoami", _tag(ctx, f"honest_{i}", tenant="mallory", ids=[20]))
                      for i in range(5)]}
