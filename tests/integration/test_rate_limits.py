"""Rate limits (store/rates.py, fairness/picker.py): token buckets in
Postgres per tenant, per tenant and kind, and per kind across tenants.

Every test drives the pick itself, `claim_next(conn, request, priority,
now=...)`, at explicit times: nothing waits. The times start at `base`, ten
minutes ahead of the database clock, because `set_rate_limit` stamps a
bucket with the database's own now(): a bucket set (or changed) before
`base` is full, at its burst, at the first pick, and from then on only the
explicit times of the picks move its tokens, so every count below is exact.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import subprocess
from collections import Counter
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any

import pytest

import tenantq
from tenantq import JobSpec, Queue
from tenantq.domain.records import Batch
from tenantq.fairness import ClaimRequest, claim_next
from tenantq.fairness.drr import Mode
from tenantq.store.db import Conn, Database
from tests.integration.helpers import db_now, fetch_all, scalar, table_counts

NOOP = "demo.noop"
RENDER = "reports.render"
MAIL = "mail.send"
API = "api.call"
# how far ahead of the database clock the picks happen (see the docstring)
AHEAD = timedelta(minutes=10)


@pytest.fixture
def conn(db: Database) -> Iterator[Conn]:
    with db.connect() as c:
        yield c


@pytest.fixture
def base(db: Database) -> datetime:
    return db_now(db) + AHEAD


def _request(batch_size: int = 10, fair_by: Mode = Mode.JOBS) -> ClaimRequest:
    return ClaimRequest(worker_id="rate-test", driver="test", batch_size=batch_size, lease_seconds=3600,
                        fair_by=fair_by)


def _at(base: datetime, seconds: float) -> datetime:
    return base + timedelta(seconds=seconds)


def _pick(conn: Conn, at: datetime, request: ClaimRequest | None = None) -> Batch | None:
    return claim_next(conn, request or _request(), "default", now=at)


def _picks_until_none(conn: Conn, at: datetime, request: ClaimRequest | None = None,
                      most: int = 500) -> list[Batch]:
    """Every batch the picks at one instant hand out (until one finds nothing)."""
    out: list[Batch] = []
    for _ in range(most):
        batch = _pick(conn, at, request)
        if batch is None:
            return out
        out.append(batch)
    pytest.fail(f"{most} picks at one instant never ran dry")


def _claimed(batches: list[Batch]) -> Counter[str]:
    """Jobs claimed per tenant."""
    return Counter({t: sum(len(b.jobs) for b in batches if b.tenant_id == t)
                    for t in {b.tenant_id for b in batches}})


def _jobs(tenant: str, kind: str, n: int) -> list[JobSpec]:
    return [JobSpec(tenant=tenant, kind=kind) for _ in range(n)]


def _deficit(db: Database, tenant: str) -> float:
    return float(scalar(db, "SELECT deficit FROM queues WHERE tenant_id = %(t)s AND priority = 'default'",
                        {"t": tenant}))


def _limit_rows(db: Database) -> list[dict[str, Any]]:
    return fetch_all(db, "SELECT tenant_id, kind, per_second, burst, tokens, refilled_at, next_tenant, "
                         "next_until FROM rate_limits ORDER BY tenant_id, kind")


# -- setting limits ------------------------------------------------------

def test_rates_read_per_second_minute_and_hour_with_a_default_burst(queue: Queue) -> None:
    row = queue.set_rate_limit("acme", rate="10/s", burst=20)
    assert (row["tenant_id"], row["kind"], row["per_second"], row["burst"], row["tokens"]) == (
        "acme", "", 10.0, 20.0, 20.0), "a new bucket starts full"
    queue.set_rate_limit("acme", RENDER, rate="120/m")
    queue.set_rate_limit(kind=API, rate="7200/h", burst=3)
    queue.set_rate_limit("slow", rate="30/m")  # half a token a second: the burst is at least 1
    queue.set_rate_limit("numeric", rate=2.5)  # a number is per second
    listed = {(r["tenant_id"], r["kind"]): (r["per_second"], r["burst"]) for r in queue.rate_limits()}
    assert listed == {
        ("acme", ""): (10.0, 20.0),
        ("acme", RENDER): (2.0, 2.0),  # default burst: one second's worth
        ("", API): (2.0, 3.0),
        ("slow", ""): (0.5, 1.0),
        ("numeric", ""): (2.5, 2.5),
    }
    # one tenant's view: its own bucket, its kinds' and the kinds' global ones
    assert [(r["tenant_id"], r["kind"]) for r in queue.rate_limits("acme")] == [
        ("", API), ("acme", ""), ("acme", RENDER)]
    assert [(r["tenant_id"], r["kind"]) for r in queue.rate_limits("nobody")] == [("", API)]


# (tenant, kind, rate, burst) that set_rate_limit must refuse
BAD_LIMITS: list[tuple[str | None, str | None, Any, Any]] = [
    ("acme", None, "10/x", None),
    ("acme", None, "0/s", None),
    ("acme", None, "-1/s", None),
    ("acme", None, "inf/s", None),
    ("acme", None, "nan/s", None),
    ("acme", None, "1e3/s", None),
    ("acme", None, "10", None),
    ("acme", None, "", None),
    ("acme", None, "2000000/s", None),  # over the 1e6/s bound
    ("acme", None, 0, None),
    ("acme", None, -1, None),
    ("acme", None, math.inf, None),
    ("acme", None, math.nan, None),
    ("acme", None, True, None),
    ("acme", None, "10/s", 0),
    ("acme", None, "10/s", -1),
    ("acme", None, "10/s", 0.5),
    ("acme", None, "10/s", math.inf),
    ("acme", None, "10/s", math.nan),
    ("acme", None, "10/s", 2e6),
    ("acme", None, "10/s", "5"),
    ("acme", None, "10/s", True),
    ("acme", RENDER, "0/m", None),
    (None, API, "10/x", None),
    (None, API, "10/s", 0),
    (None, None, "10/s", None),  # neither a tenant nor a kind
    (None, None, None, None),
    ("bad tenant!", None, "10/s", None),
    (None, "9bad kind", "10/s", None),
]


def test_bad_limits_are_refused_in_one_line_and_write_nothing(queue: Queue, db: Database) -> None:
    # existing limits a bad update must not touch
    queue.set_rate_limit("acme", rate="5/s", burst=5)
    queue.set_rate_limit("acme", RENDER, rate="1/s")
    queue.set_rate_limit(kind=API, rate="3/s")
    before, counts = _limit_rows(db), table_counts(db)
    for tenant, kind, rate, burst in BAD_LIMITS:
        case = f"set_rate_limit({tenant!r}, {kind!r}, rate={rate!r}, burst={burst!r})"
        try:
            queue.set_rate_limit(tenant, kind, rate=rate, burst=burst)
        except tenantq.InvalidInput as exc:
            message = str(exc)
        else:
            pytest.fail(f"{case} was accepted")
        assert message.strip() and "\n" not in message and len(message) < 300, (case, message)
        assert _limit_rows(db) == before, case
        assert table_counts(db) == counts, case


# -- a tenant's bucket ---------------------------------------------------

def test_a_tenant_gets_its_burst_then_is_skipped_without_holding_back_others(
        queue: Queue, db: Database, conn: Conn, base: datetime) -> None:
    queue.set_rate_limit("a-limited", rate="5/s", burst=5)
    queue.enqueue_many(_jobs("a-limited", NOOP, 50) + _jobs("b-free", NOOP, 50))

    first = _pick(conn, base)
    assert first is not None and first.tenant_id == "a-limited"
    assert len(first.jobs) == 5, "the batch is sized by the tokens (5), not the batch size (10)"
    second = _pick(conn, base)
    assert second is not None and (second.tenant_id, len(second.jobs)) == ("b-free", 10)
    # a-limited's turn comes round again (b-free's is over), but its bucket is
    # empty: the same pick passes it over and serves b-free instead
    third = _pick(conn, base)
    assert third is not None and (third.tenant_id, len(third.jobs)) == ("b-free", 10)
    rest = _picks_until_none(conn, base)
    assert {b.tenant_id for b in rest} == {"b-free"}
    assert sum(len(b.jobs) for b in rest) == 30, "b-free ran its whole backlog at t=0"
    # passed over with no credit and no charge
    assert _deficit(db, "a-limited") == 0.0
    assert scalar(db, "SELECT has_work FROM queues WHERE tenant_id = 'a-limited'") is True
    # a second later, five tokens more
    later = _picks_until_none(conn, _at(base, 1.0))
    assert [(b.tenant_id, len(b.jobs)) for b in later] == [("a-limited", 5)]


def test_the_bucket_refills_at_its_rate_and_never_gives_more_than_rate_t_plus_burst(
        queue: Queue, conn: Conn, base: datetime) -> None:
    rate, burst = 5.0, 5.0
    queue.set_rate_limit("a-limited", rate=f"{rate:g}/s", burst=burst)
    queue.enqueue_many(_jobs("a-limited", NOOP, 200) + _jobs("b-free", NOOP, 1500))
    request = _request(batch_size=10)
    limited, held_back = 0, []
    step, steps = 0.1, 40
    for i in range(steps + 1):
        t = i * step
        for _ in range(3):  # three slots pick at each instant
            batch = _pick(conn, _at(base, t), request)
            if batch is None:
                held_back.append(t)  # b-free has work at every instant: nobody may wait
                continue
            if batch.tenant_id == "a-limited":
                limited += len(batch.jobs)
        assert limited <= math.floor(rate * t + burst + 1e-9), (t, limited)
    assert held_back == [], f"picks found nothing while b-free had work, at {held_back}"
    # every token was used: the limit is a rate, not less
    assert limited == rate * steps * step + burst
    # after a pause of 0.6 s the bucket holds 3 tokens: one batch of 3
    batches = [b for b in _picks_until_none(conn, _at(base, steps * step + 0.6), request)
               if b.tenant_id == "a-limited"]
    assert [len(b.jobs) for b in batches] == [3]
    # and after a long pause no more than the burst
    batches = [b for b in _picks_until_none(conn, _at(base, 3600), request) if b.tenant_id == "a-limited"]
    assert [len(b.jobs) for b in batches] == [5]


def test_picks_stamped_out_of_order_never_give_more_than_rate_t_plus_burst(
        queue: Queue, conn: Conn, base: datetime) -> None:
    """A pick's clock is its transaction's start (now()), taken before it
    waits for the cursor lock; so with several slots, a pick stamped 2.2 s
    can spend tokens after one stamped 3.0 s did. It must not move the
    bucket's refill time back (that would count 2.2 s..3.0 s twice)."""
    rate, burst = 1.0, 4.0
    queue.set_rate_limit("acme", rate=f"{rate:g}/s", burst=burst)
    queue.enqueue_many(_jobs("acme", NOOP, 50))
    one, many = _request(batch_size=1), _request(batch_size=10)
    claimed = sum(len(b.jobs) for b in _picks_until_none(conn, base, many))
    assert claimed == burst
    for seconds, request in [(3.0, one), (2.2, one), (4.5, many)]:
        batch = _pick(conn, _at(base, seconds), request)
        claimed += 0 if batch is None else len(batch.jobs)
    assert claimed <= math.floor(rate * 4.5 + burst), (
        f"{claimed} jobs claimed by t = 4.5 s of a {rate:g}/s limit with burst {burst:g}")


def test_a_tenant_and_kind_limit_bounds_only_that_kind(queue: Queue, db: Database, conn: Conn,
                                                        base: datetime) -> None:
    queue.set_rate_limit("acme", RENDER, rate="2/s", burst=2)
    mixed = [JobSpec(tenant="acme", kind=RENDER if i % 2 == 0 else MAIL) for i in range(20)]
    ids = queue.enqueue_many(mixed + _jobs("beta", RENDER, 5))
    acme_render = {ids[i] for i in range(0, 20, 2)}

    first = _pick(conn, base)
    assert first is not None and first.tenant_id == "acme"
    # the quota holds within a batch of mixed kinds: 2 renders, the rest mail
    assert Counter(j.kind for j in first.jobs) == {RENDER: 2, MAIL: 8}
    assert {j.id for j in first.jobs if j.kind == RENDER} == set(sorted(acme_render)[:2]), "oldest first"
    rest = _picks_until_none(conn, base)
    by_tenant_kind = Counter((b.tenant_id, j.kind) for b in [first, *rest] for j in b.jobs)
    # acme's other kind runs freely; another tenant's renders are not limited
    assert by_tenant_kind == {("acme", RENDER): 2, ("acme", MAIL): 10, ("beta", RENDER): 5}
    # the pick that found only empty-bucket kinds kept the queue's hint
    assert scalar(db, "SELECT has_work FROM queues WHERE tenant_id = 'acme'") is True
    assert _deficit(db, "acme") <= 0.0
    later = _picks_until_none(conn, _at(base, 1.0))
    assert [(b.tenant_id, [j.kind for j in b.jobs]) for b in later] == [("acme", [RENDER, RENDER])]
    assert _picks_until_none(conn, _at(base, 1.4)) == []
    assert [len(b.jobs) for b in _picks_until_none(conn, _at(base, 1.5))] == [1]


def test_a_tenant_limit_and_a_kind_limit_together_take_the_smaller(
        queue: Queue, conn: Conn, base: datetime) -> None:
    queue.set_rate_limit("acme", rate="6/s", burst=6)
    queue.set_rate_limit("acme", RENDER, rate="1/s", burst=1)
    queue.enqueue_many([JobSpec(tenant="acme", kind=RENDER if i % 2 == 0 else MAIL) for i in range(40)])
    batches = _picks_until_none(conn, base)
    # the tenant's 6 tokens bound the batch, the kind's 1 token its renders
    assert [Counter(j.kind for j in b.jobs) for b in batches] == [{RENDER: 1, MAIL: 5}]
    batches = _picks_until_none(conn, _at(base, 1.0))
    assert [Counter(j.kind for j in b.jobs) for b in batches] == [{RENDER: 1, MAIL: 5}]


# -- a kind's bucket shared by every tenant ------------------------------

def test_a_global_kind_limit_holds_across_tenants_who_take_turns(
        queue: Queue, conn: Conn, base: datetime) -> None:
    rate, burst = 2.0, 2.0
    queue.set_rate_limit(kind=API, rate=f"{rate:g}/s", burst=burst)
    queue.enqueue_many(_jobs("t1", API, 40) + _jobs("t2", API, 40))
    served: list[tuple[float, str, int]] = []
    step, steps = 0.25, 40
    for i in range(steps + 1):
        t = i * step
        for _ in range(2):
            batch = _pick(conn, _at(base, t))
            if batch is not None:
                served.append((t, batch.tenant_id, len(batch.jobs)))
        total = sum(n for _, _, n in served)
        assert total <= math.floor(rate * t + burst + 1e-9), (t, served)
    total = sum(n for _, _, n in served)
    assert total == rate * steps * step + burst, served
    # the first tenant takes the burst; after it, every token goes to the
    # other tenant than the last: each gets its turn (`next_tenant`)
    tenants = [tenant for _, tenant, _ in served]
    assert all(a != b for a, b in itertools.pairwise(tenants)), served
    share = Counter[str]()
    for _, tenant, n in served:
        share[tenant] += n
    assert abs(share["t1"] - share["t2"]) <= burst, share


def test_a_tenant_without_jobs_of_a_limited_kind_does_not_take_its_turn(
        queue: Queue, conn: Conn, base: datetime) -> None:
    """The kind's turn is for tenants waiting to run that kind. A tenant
    whose queue holds only other kinds (b-mail, visited on every round)
    must not take the turn for the kind's next token: t1, the only tenant
    with api.call work, gets every api.call token."""
    rate, burst = 1.0, 1.0
    queue.set_rate_limit(kind=API, rate=f"{rate:g}/s", burst=burst)
    queue.enqueue_many(_jobs("b-mail", MAIL, 2000) + _jobs("t1", API, 50))
    request = _request(batch_size=5)
    api_calls: list[float] = []
    step, steps = 0.25, 32
    for i in range(steps + 1):
        t = i * step
        for _ in range(2):
            batch = _pick(conn, _at(base, t), request)
            assert batch is not None, "b-mail has work at every instant"
            if batch.tenant_id == "t1":
                api_calls.extend(t for _ in batch.jobs)
    expected = rate * steps * step + burst
    assert len(api_calls) == expected, (
        f"t1 got {len(api_calls)} api.call jobs in {steps * step:g} s of a {rate:g}/s limit "
        f"(burst {burst:g}), not {expected:g}; at t = {api_calls}")


# -- changing and removing limits ----------------------------------------

def test_a_changed_limit_applies_at_the_next_pick_and_removing_it_lifts_it(
        queue: Queue, db: Database, conn: Conn, base: datetime) -> None:
    queue.set_rate_limit("acme", rate="5/s", burst=5)
    queue.enqueue_many(_jobs("acme", NOOP, 200))
    request = _request(batch_size=50)
    assert [len(b.jobs) for b in _picks_until_none(conn, base, request)] == [5]

    # raised: a changed bucket keeps its tokens (none), capped at the new burst...
    changed = queue.set_rate_limit("acme", rate="20/s", burst=20)
    assert (changed["per_second"], changed["burst"]) == (20.0, 20.0)
    assert changed["tokens"] == pytest.approx(0.0, abs=1e-6)
    # ...and the next picks go by the new rate and burst (the old ones would
    # give 5 and then 2)
    assert [len(b.jobs) for b in _picks_until_none(conn, _at(base, 1.0), request)] == [20]
    assert [len(b.jobs) for b in _picks_until_none(conn, _at(base, 1.5), request)] == [10]

    # lowered: one token a minute; the bucket keeps its (no) tokens and
    # refills from its last refill (base + 1.5 s) at the new rate
    queue.set_rate_limit("acme", rate="1/m", burst=1)
    assert _picks_until_none(conn, _at(base, 2.0), request) == []
    assert _picks_until_none(conn, _at(base, 3.0), request) == [], "20/s would have given 20"
    assert _picks_until_none(conn, _at(base, 61.0), request) == []
    assert [len(b.jobs) for b in _picks_until_none(conn, _at(base, 62.0), request)] == [1]

    # removed: the next pick takes a full batch
    assert queue.set_rate_limit("acme", rate=None)["removed"] is True
    assert queue.rate_limits() == []
    assert queue.set_rate_limit("acme", rate=None)["removed"] is False
    assert [len(b.jobs) for b in _picks_until_none(conn, _at(base, 62.0), request)] == [50, 50, 50, 14]
    assert scalar(db, "SELECT count(*) FROM jobs WHERE status = 'pending'") == 0


def test_a_removed_global_kind_limit_lets_both_tenants_run(queue: Queue, conn: Conn, base: datetime) -> None:
    queue.set_rate_limit(kind=API, rate="1/m", burst=1)
    queue.enqueue_many(_jobs("t1", API, 10) + _jobs("t2", API, 10))
    assert _claimed(_picks_until_none(conn, base)) == {"t1": 1}
    assert _picks_until_none(conn, _at(base, 30)) == []
    queue.set_rate_limit(kind=API, rate=None)
    assert _claimed(_picks_until_none(conn, _at(base, 30))) == {"t1": 9, "t2": 10}


# -- why a job waits -----------------------------------------------------

def test_a_pending_job_of_an_empty_bucket_says_rate_limited_and_when_the_next_token_comes(
        queue: Queue, conn: Conn, base: datetime, cli_env: dict[str, str], tenantq_cmd: list[str]) -> None:
    queue.set_rate_limit("acme", rate="5/s", burst=5)
    queue.set_rate_limit("beta", RENDER, rate="2/s", burst=1)
    queue.set_rate_limit(kind=API, rate="1/m", burst=1)
    acme = queue.enqueue_many(_jobs("acme", NOOP, 8))
    beta = queue.enqueue_many(_jobs("beta", RENDER, 3))
    gamma = queue.enqueue_many(_jobs("gamma", API, 3) + _jobs("gamma", NOOP, 1))
    free = queue.enqueue("delta", NOOP, delay=3600)
    assert _claimed(_picks_until_none(conn, base)) == {"acme": 5, "beta": 1, "gamma": 2}

    # the buckets were last spent at `base`, ahead of the database clock: no
    # refill since, so the time to the next token is one token's worth
    pending = queue.job(acme[-1])
    assert pending.status == "pending"
    assert pending.why_waiting[0] == "rate limited (tenant acme, 5/s): next token in 0.2 s", (
        pending.why_waiting)
    assert queue.job(beta[-1]).why_waiting[0] == (
        "rate limited (tenant beta, kind reports.render, 2/s): next token in 0.5 s")
    assert queue.job(gamma[-2]).why_waiting[0] == (
        "rate limited (kind api.call, all tenants, 1/m): next token in 60.0 s")
    assert not any("rate limited" in r for r in queue.job(free).why_waiting)

    # `tenantq job ID` says it too
    env = {**cli_env, "COLUMNS": "200"}
    shown = subprocess.run([*tenantq_cmd, "job", str(acme[-1])], env=env, capture_output=True, text=True,
                           timeout=60, check=False)
    assert shown.returncode == 0, shown.stderr
    assert re.search(r"rate limited \(tenant acme, 5/s\): next token in 0\.2 s", shown.stdout), shown.stdout
    as_json = subprocess.run([*tenantq_cmd, "job", str(acme[-1]), "--json"], env=env, capture_output=True,
                             text=True, timeout=60, check=False)
    assert as_json.returncode == 0, as_json.stderr
    assert json.loads(as_json.stdout)["why_waiting"][0] == pending.why_waiting[0]


# -- fairness while limited ----------------------------------------------

@pytest.mark.parametrize("fair_by", [Mode.JOBS, Mode.RUNTIME])
def test_a_limited_tenant_banks_no_credit_and_takes_only_its_share_once_lifted(
        queue: Queue, db: Database, conn: Conn, base: datetime, fair_by: Mode) -> None:
    queue.set_rate_limit("a-limited", rate="1/s", burst=1)
    queue.enqueue_many(_jobs("a-limited", NOOP, 400) + _jobs("b-free", NOOP, 1000))
    request = _request(batch_size=5, fair_by=fair_by)
    deficits: list[float] = []
    limited = 0
    step, steps = 0.25, 40
    for i in range(steps + 1):
        for _ in range(2):
            batch = _pick(conn, _at(base, i * step), request)
            assert batch is not None
            limited += len(batch.jobs) if batch.tenant_id == "a-limited" else 0
            deficits.append(_deficit(db, "a-limited"))
    assert limited == 1 + steps * step
    # ~70 picks passed it over: its credit never grew past one quantum
    assert max(deficits) <= request.quantum, max(deficits)

    queue.set_rate_limit("a-limited", rate=None)
    later = _at(base, steps * step + 1)
    order = []
    for _ in range(40):
        batch = _pick(conn, later, request)
        assert batch is not None
        order.append((batch.tenant_id, len(batch.jobs)))
    shares = Counter[str]()
    for tenant, n in order:
        shares[tenant] += n
    total = sum(shares.values())
    # no banked credit to spend: it gets its normal share, and no more
    assert shares["a-limited"] <= total / 2 + request.batch_size, (shares, order[:10])
    assert shares["a-limited"] >= total / 2 - request.batch_size, (shares, order[:10])
    assert [t for t, _ in order[:2]] in (["a-limited", "b-free"], ["b-free", "a-limited"]), order[:4]
