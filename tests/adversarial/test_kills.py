"""Rules H2, H5 and C1: a job that kills or stops what runs it (its batch
supervisor, the runner, every process it may signal, itself), segfaults,
exits without a word, or closes its result pipe and hangs with SIGALRM
blocked ends with a classified reason within its bounded time, and its
attempt is counted: with max_attempts=3 it is dead after exactly three
attempts, and its attempts never go down (each runs alone in its batch, so
it is always the job the host handed out: no refund). Under gVisor the job
cannot even signal the runner or the supervisor. The neighbour's jobs keep
finishing meanwhile."""

from __future__ import annotations

from tests.adversarial.harness import Arena

ATTEMPTS = 3
HANDLER_TIMEOUT = 2.0  # adv.kill's timeout
# rule H5: a job ends within its timeout + 3 s; allow a sandbox start per attempt on top
PER_ATTEMPT_BOUND = HANDLER_TIMEOUT + 3.0 + 5.0
SIGNALS_TO_OTHERS = ("kill_parent", "kill_init", "kill_all", "stop_parent", "stop_all", "term_init",
                     "stop_init")
ALWAYS_DEAD = {"kill_self": "killed by signal 9", "segfault": "crashed: SIGSEGV", "exit_silently": "crashed:",
               "close_result_and_hang": "timeout after", "stop_self": "timeout after"}


def test_killing_or_stopping_the_guest_is_charged_and_contained(arena: Arena) -> None:
    arena.neighbour(1)
    jobs = {v: arena.attack("adv.kill", {"variant": v}, max_attempts=ATTEMPTS)
            for v in (*SIGNALS_TO_OTHERS, *ALWAYS_DEAD)}
    arena.run("--concurrency", "3", "--batch-size", "1", once=False, timeout=220)

    for variant, job_id in jobs.items():
        info = arena.job(job_id)
        error = info.last_error or ""
        if variant in ALWAYS_DEAD:
            arena.expect(info.status == "dead" and error.startswith(ALWAYS_DEAD[variant]),
                         f"{variant}: {info.status} after {info.attempts} attempts, {error[:200]!r} "
                         f"(expected dead, {ALWAYS_DEAD[variant]!r})")
        if arena.driver == "gvisor" and variant in SIGNALS_TO_OTHERS:
            # rule C1: the job's uid differs from the runner's and the supervisor's
            arena.expect(info.status == "done" and isinstance(info.result, dict)
                         and info.result.get("kill") in ("EPERM", "ESRCH"),
                         f"rule C1 (gvisor): {variant} was not refused: {info.status} {info.result} "
                         f"{error[:200]!r}")
        if info.status == "dead" and info.finished_at is not None and info.started_at is not None:
            took = (info.finished_at - info.started_at).total_seconds()
            arena.expect(took <= PER_ATTEMPT_BOUND,
                         f"rule H5: {variant}'s last attempt took {took:.1f} s from its lease to its end "
                         f"(bound: timeout {HANDLER_TIMEOUT:g} s + 3 s + a sandbox start)")
    arena.verdict()
