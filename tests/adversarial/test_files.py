"""Rule H1: the host never touches a guest-writable path by name. Hostile
jobs plant symlinks (to the host marker file, by absolute and by climbing
relative path, to a host directory, to /dev/zero, /dev/urandom, /proc/1/fd/1,
to themselves), FIFOs with and without a reader, listening Unix sockets,
empty files and directories under every name the host might use (results
files, batch files, stop files, sandbox.json, stderr, ...) in every directory
a job can see (the work dir, /tmp, /dev/shm, the cwd, and the read-only
/tenantq, /tenantq/egress and /), then swap them atomically in a tight loop
while the job runs and, from a child, after it returned, racing every host
action at job end, batch end, keep-warm and destroy. Nothing may arrive in
a planted FIFO, socket or file, and the marker must be neither read nor
changed."""

from __future__ import annotations

from typing import Any

from tests.adversarial.harness import Arena


def test_planted_links_fifos_and_sockets_are_never_followed(arena: Arena) -> None:
    payload: dict[str, Any] = {"marker": str(arena.marker.path), "victim": str(arena.marker.victim),
                               "seconds": 2.0}
    arena.neighbour(1)
    plants = [arena.attack("adv.plant", payload, charged=False)]
    arena.sibling(2)
    plants.append(arena.attack("adv.plant", payload, charged=False))
    arena.sibling(3)
    plants.append(arena.attack("adv.plant", payload, charged=False))
    arena.sibling(4)
    arena.neighbour(5)
    arena.run("--concurrency", "2", "--batch-size", "3", "--keep-warm", "30", timeout=150)

    for job_id in plants:
        status, _, report, error = arena.outcome(job_id)
        arena.expect(status == "done", f"adv.plant {job_id} did not report: {status} {error[:800]}")
        if status != "done":
            continue
        arena.expect(report["planted"] > 500, f"adv.plant {job_id} planted only {report['planted']} objects "
                                              f"(errors {report['errors']})")
        arena.expect(report["fifo_bytes"] == 0,
                     f"rule H1: {report['fifo_bytes']} bytes arrived in FIFOs planted in the sandbox")
        arena.expect(report["socket_connections"] == 0,
                     f"rule H1: {report['socket_connections']} connections to sockets planted in the sandbox")
        arena.expect(report["files_written"] == [],
                     f"rule H1: planted empty files were written to: {report['files_written']}")
        for path, outcome in report["reads"].items():
            arena.expect(not outcome.startswith("ok"), f"the sandbox read the host's {path}: {outcome}")
    arena.verdict()
