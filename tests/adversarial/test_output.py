"""Rule H3 and H4: whatever a job prints or returns costs the host a bounded
amount, and a result the host must not store fails that job alone with a
classified reason. Hostile jobs print 1 GiB to stdout and 1 GiB to stderr in
1 MiB chunks, write a 1 GiB line without a newline to every descriptor they
hold (the result pipe last), flood and then fail (the error keeps only a
bounded tail), and return results over the limit (3 MiB), 10,000 levels
deep, NaN, Infinity, a lone surrogate, a NUL, an int of 5,000 digits,
something that is not JSON at all, and an 8 MiB exception message; a 900 kB
result must still round-trip. The worker keeps serving its neighbour
throughout, with its RSS and its log bounded."""

from __future__ import annotations

import json

from tests.adversarial.harness import Arena

GIB = 1 << 30


def test_floods_of_output_cost_the_host_nothing(arena: Arena) -> None:
    both = arena.attack("adv.flood", {"fds": [1, 2], "bytes": GIB})
    every_fd = arena.attack("adv.flood", {"fds": "all", "bytes": GIB, "newlines": False})
    then_fail = arena.attack("adv.flood", {"fds": [2, 1], "bytes": 64 << 20, "then": "raise"}, max_attempts=2)
    arena.run("--concurrency", "3", "--batch-size", "1", once=False, timeout=200)

    status, _, result, error = arena.outcome(both)
    arena.expect(status == "done" and result == {"written": {"1": GIB, "2": GIB}},
                 f"1 GiB on stdout and on stderr: {status} {str(result)[:200]} {error[:300]}")
    status, _, result, error = arena.outcome(every_fd)
    arena.expect(status == "dead", f"a 1 GiB line in the result pipe was stored: {status} {str(result)[:99]}")
    status, _, result, error = arena.outcome(then_fail)
    arena.expect(status == "dead" and "RuntimeError" in error and "flooded" in error,
                 f"a job that flooded then raised lost its reason: {status} {error[:300]!r}")
    arena.verdict()


RESULTS_REFUSED = ("huge", "deep", "nan", "infinity", "bigint", "unserialisable", "huge_error")


def test_results_the_host_must_not_store_fail_alone(arena: Arena) -> None:
    arena.neighbour(1)
    refused = {}
    for n, variant in enumerate(RESULTS_REFUSED):
        refused[variant] = arena.attack("adv.result", {"variant": variant}, charged=False)
        arena.sibling(10 + n)
    large = arena.attack("adv.result", {"variant": "large_ok"}, charged=False)
    unstorable = {v: arena.attack("adv.result", {"variant": v}, charged=False) for v in ("surrogate", "nul")}
    arena.sibling(30)
    arena.neighbour(2)
    arena.run("--concurrency", "2", "--batch-size", "4", timeout=150)

    for variant, job_id in refused.items():
        status, _, result, error = arena.outcome(job_id)
        arena.expect(status == "dead" and result is None,
                     f"result {variant!r} was stored: {status} {str(result)[:200]} {error[:200]}")
    status, _, result, error = arena.outcome(large)
    arena.expect(status == "done" and result == {"blob": "y" * 900_000},
                 f"a 900 kB result did not round-trip: {status} {error[:300]}")
    for variant, job_id in unstorable.items():
        status, _, result, error = arena.outcome(job_id)
        text = json.dumps(result)
        arena.expect(status == "dead" or ("\\u0000" not in text and "\\ud800" not in text),
                     f"result {variant!r}: {status} {text[:200]}")
    arena.verdict()
