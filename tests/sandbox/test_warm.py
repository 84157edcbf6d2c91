"""Warm starts on real sandboxes: templates restored per batch (gvisor),
kept-warm sandboxes fed batch after batch (both drivers), hibernation, and
the isolation each of them must keep."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import tests.apps.warm  # noqa: F401  (registers the warm.* handlers in this process too)
from tenantq.dispatch.executors.warm import WarmPolicy
from tenantq.registry import REGISTRY, Registry
from tenantq.sandbox.driver import SandboxDriver
from tenantq.sandbox.drivers.gvisor import GVisorDriver
from tenantq.testing import wait_until
from tests.sandbox.conftest import RUNSC_OK, files_containing, runsc_containers, sandbox_dirs
from tests.sandbox.warm_harness import Harness

needs_runsc = pytest.mark.skipif(not RUNSC_OK, reason="gvisor: runsc is not installed or does not work here "
                                                      "(templates and hibernation need checkpoint/restore)")


def _tree_digest(path: Path) -> str:
    digest = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        digest.update(f.name.encode() + f.read_bytes())
    return digest.hexdigest()


# -- templates (gvisor) ----------------------------------------------------------


@needs_runsc
def test_batches_restore_from_the_template_and_see_the_warmed_state(
        data_dir: Path, harness: Callable[..., Harness]) -> None:
    h = harness(GVisorDriver(data_dir), WarmPolicy())
    first = h.result("warm.state")
    second = h.result("warm.state")
    assert [o for _, o in h.origins] == ["template", "template"]
    assert len({sid for sid, _ in h.origins}) == 2, "each batch gets its own sandbox"
    templates = h.executor.store.templates()
    assert len(templates) == 1
    built = float(templates[0].meta["created"])
    for seen in (first, second):
        # the warmup ran once, in the template, before it was checkpointed
        assert seen["warmups"] == 1 and seen["modules_loaded"], seen
        assert seen["warmed_at"] < built
    assert first["boot"] == second["boot"], "both restored from the same image"


@needs_runsc
def test_children_of_one_image_are_independent_and_reseeded(
        data_dir: Path, harness: Callable[..., Harness]) -> None:
    h = harness(GVisorDriver(data_dir), WarmPolicy())
    baseline_tmp = h.result("warm.inspect")["tmp"]
    (template,) = h.executor.store.templates()
    image_before = _tree_digest(template.image)
    polluted = h.run("warm.pollute", "warm.inspect")
    # every job is a fresh process of the pristine supervisor (rule C2): not
    # even a sibling in the same batch sees the pollution
    assert polluted[1].result["boot"] != "corrupted" and polluted[1].result["tmp"] == baseline_tmp, polluted
    clean = h.result("warm.inspect")
    assert clean["boot"] != "corrupted" and clean["extra"] is None and clean["env"] is None, clean
    assert clean["tmp"] == baseline_tmp and clean["sleepers"] == [], clean
    assert "left-behind.txt" not in clean["work"], clean
    a, b = h.result("warm.state"), h.result("warm.state")
    for field in ("urandom", "random", "uuid"):
        assert a[field] != b[field], f"two children of one image share {field}"
    assert _tree_digest(template.image) == image_before, "a child changed the image"


@needs_runsc
def test_a_code_change_makes_a_new_template_and_the_old_one_is_collected(
        tmp_path: Path, data_dir: Path, harness: Callable[..., Harness]) -> None:
    package = tmp_path / "app_src" / "changing_app"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(textwrap.dedent("""
        import tenantq

        @tenantq.handler("changing.version", timeout=10, memory_mb=64)
        def version(payload, ctx):
            return 1
    """))
    sys.path.insert(0, str(package.parent))
    registry = Registry()
    try:
        import changing_app  # noqa: F401  (registers into the global registry)

        for kind in ("changing.version",):
            handler = REGISTRY.get(kind)
            assert handler is not None
            registry.add(handler)
        h = harness(GVisorDriver(data_dir), WarmPolicy(), app="changing_app", registry=registry)
        assert h.result("changing.version") == 1
        (old,) = h.executor.store.templates()
        (package / "__init__.py").write_text((package / "__init__.py").read_text().replace(
            "return 1", "return 2"))
        spec = h.executor.spec("acme", 60)
        # noticed on its own within the key's recheck interval
        wait_until(lambda: h.executor.template_key(spec) != old.key, timeout=10,
                   message="the edit to change the template key")
        assert h.result("changing.version") == 2, "the sandbox runs the edited code"
        keys = [t.key for t in h.executor.store.templates()]
        assert len(keys) == 2 and old.key in keys, keys
        new_key = next(k for k in keys if k != old.key)
        assert [o for _, o in h.origins] == ["template", "template"]
        # the old template is no longer current and unused: collected
        removed = h.executor.store.gc(current={new_key}, superseded_grace=0.0)
        assert removed == [f"template {old.key}"]
        assert [t.key for t in h.executor.store.templates()] == [new_key]
    finally:
        sys.path.remove(str(package.parent))
        sys.modules.pop("changing_app", None)


@needs_runsc
def test_nothing_a_job_does_removes_the_template(data_dir: Path, harness: Callable[..., Harness]) -> None:
    """Rule S1: a template goes only when a restored sandbox dies before it was
    handed a job. A job that kills its batch, crashes or ends its own process
    without a word in a restored sandbox changes nothing about the template."""
    h = harness(GVisorDriver(data_dir), WarmPolicy())
    h.result("warm.state")
    (template,) = h.executor.store.templates()
    for kind in ("box.kill_sandbox", "box.segfault", "box.spin"):
        (ended,) = h.run(kind)
        assert not ended.ok, ended
    again = h.result("warm.state")
    assert again["warmups"] == 1, again
    assert [o for _, o in h.origins] == ["template"] * 5, h.origins
    assert [t.key for t in h.executor.store.templates()] == [template.key]
    assert h.executor.warm.snapshots, "snapshots were turned off by what a job did"


@needs_runsc
def test_checkpoint_failure_falls_back_to_cold_starts_and_says_so(
        tmp_path: Path, data_dir: Path, harness: Callable[..., Harness],
        caplog: pytest.LogCaptureFixture) -> None:
    # a runsc whose checkpoint fails, like an older or restricted runsc
    fake = tmp_path / "runsc"
    real = shutil.which("runsc")
    fake.write_text(f'#!/bin/sh\nfor a; do [ "$a" = checkpoint ] && '
                    f'{{ echo "checkpoint: not supported" >&2; exit 1; }}; done\nexec {real} "$@"\n')
    fake.chmod(0o755)
    h = harness(GVisorDriver(data_dir, runsc=str(fake)), WarmPolicy())
    with caplog.at_level(logging.WARNING, logger="tenantq.sandbox"):
        first = h.result("warm.state")
        second = h.result("warm.state")
    assert [o for _, o in h.origins] == ["cold", "cold"]
    assert first["boot"] != second["boot"], "each cold sandbox warms up on its own"
    said = [r.getMessage() for r in caplog.records if "snapshots off" in r.getMessage()]
    assert len(said) == 1 and "checkpoint: not supported" in said[0], said
    assert h.executor.store.templates() == []


# -- kept warm (both drivers) ---------------------------------------------------


def test_a_kept_warm_sandbox_shows_batch_k_nothing_of_batch_k_minus_1(
        driver: SandboxDriver, harness: Callable[..., Harness]) -> None:
    h = harness(driver, WarmPolicy(keep_warm_seconds=60))
    first = h.result("warm.state", env={"TOKEN": "first-batch-secret"})
    # what a fresh sandbox's /tmp holds: nothing, or the mount points of code
    # that lives under the host's /tmp (a checkout in /tmp)
    baseline_tmp = h.result("warm.inspect")["tmp"]
    polluted = h.run("warm.pollute", env={"TOKEN": "second-batch-secret"})
    assert polluted[0].ok, polluted
    clean = h.result("warm.inspect")
    again = h.result("warm.state", env={"TOKEN": "fourth-batch-secret"})
    ids = {sid for sid, _ in h.origins}
    assert len(ids) == 1, f"one sandbox served all five batches: {h.origins}"
    assert [o for _, o in h.origins][1:] == ["warm", "warm", "warm", "warm"]
    assert clean["boot"] == first["boot"] and clean["extra"] is None and clean["env"] is None, clean
    assert clean["tmp"] == baseline_tmp and clean["sleepers"] == [], clean
    assert clean["work"] == [], clean
    # secrets are injected per batch, and only that batch's
    assert again["env"] == again["environ"] == "fourth-batch-secret"
    assert first["env"] == "first-batch-secret"


def test_a_cancel_racing_its_jobs_end_reaches_the_guest_before_the_batch_ends(
        driver: SandboxDriver, harness: Callable[..., Harness], monkeypatch: pytest.MonkeyPatch) -> None:
    """The host's cancel of the job in flight is held until that job's end
    has arrived (the worst case for the race): its frame must still reach
    the guest before the batch's `end`, never the warm parent after it (which
    takes only a `batch` command); and a stray cancel sent to a kept-warm
    sandbox between batches changes nothing: the same sandbox serves the next."""
    from tenantq.sandbox.channel import Channel

    h = harness(driver, WarmPolicy(keep_warm_seconds=60))
    sent: list[str] = []
    job_ended, end_sent = threading.Event(), threading.Event()
    cancellers: list[threading.Thread] = []
    real_send, real_receive = Channel.send, Channel.receive

    def receive(self: Channel, deadline: float, **kw: Any) -> dict[str, Any]:
        record = real_receive(self, deadline, **kw)
        if record.get("status") == "job_end":
            job_ended.set()
        return record

    def send(self: Channel, value: object, deadline: float) -> None:
        op = str(value.get("op", "secrets")) if isinstance(value, dict) else "?"
        if op == "cancel":
            assert job_ended.wait(30), "the job never ended"
            # without the session's lock, the host says `end` in this window
            end_sent.wait(2.0)
        real_send(self, value, deadline)
        sent.append(op)
        if op == "end":
            end_sent.set()
        if op == "job" and not cancellers and isinstance(value, dict):
            # the worker's listener thread, as the job is handed out
            thread = threading.Thread(target=h.executor.cancel, args=(value["job"]["id"],))
            cancellers.append(thread)
            thread.start()

    monkeypatch.setattr(Channel, "receive", receive)
    monkeypatch.setattr(Channel, "send", send)
    ended = h.run("warm.state")
    cancellers[0].join(timeout=30)
    monkeypatch.undo()
    assert ended and ended[0].ok, ended  # it had finished: the host settles it (settle.py)
    assert sent[-3:] == ["job", "cancel", "end"], sent
    # a cancel frame between batches (the one the lock now rules out)
    with h.executor.warm._lock:
        (server,) = h.executor.warm._idle
    server.running.channel.send({"op": "cancel", "seq": 0}, time.monotonic() + 5)
    assert h.result("warm.state")["env"] is None
    (first, _), (second, origin) = h.origins
    assert second == first and origin == "warm", h.origins


def test_a_warm_sandbox_is_never_shared_between_tenants(
        driver: SandboxDriver, harness: Callable[..., Harness]) -> None:
    h = harness(driver, WarmPolicy(keep_warm_seconds=60))
    h.result("warm.state", tenant="tenant-a")
    h.result("warm.state", tenant="tenant-b")
    h.result("warm.state", tenant="tenant-a")
    (a1, _), (b1, _), (a2, origin) = h.origins
    assert b1 != a1 and a2 == a1 and origin == "warm", h.origins


@pytest.mark.parametrize(("kind", "payload", "reason"), [("box.segfault", None, "crashed: SIGSEGV"),
                                                     ("box.spin", None, "timeout after 2 s"),
                                                     ("box.alloc", {"mb": 2048}, "oom: exceeded 256 MiB")])
def test_a_sandbox_that_saw_a_failure_is_not_reused(
        driver: SandboxDriver, harness: Callable[..., Harness], kind: str, payload: Any, reason: str) -> None:
    h = harness(driver, WarmPolicy(keep_warm_seconds=60))
    h.result("warm.state")
    failed = h.run(kind, payload=payload)
    assert not failed[0].ok and (failed[0].error or "").startswith(reason), failed
    h.result("warm.state")
    (first, _), (second, _), (third, origin) = h.origins
    assert second == first, "the healthy sandbox was kept for the failing batch"
    assert third != second and origin != "warm", h.origins
    assert h.executor.warm.idle_count() == 1


def test_max_batches_per_sandbox_retires_it(driver: SandboxDriver, harness: Callable[..., Harness]) -> None:
    h = harness(driver, WarmPolicy(keep_warm_seconds=60, max_batches=2))
    for _ in range(3):
        h.result("warm.state")
    (s1, _), (s2, _), (s3, _) = h.origins
    assert s1 == s2 and s3 != s2


def test_idle_sandboxes_go_after_keep_warm_and_on_close(
        driver: SandboxDriver, data_dir: Path, harness: Callable[..., Harness]) -> None:
    h = harness(driver, WarmPolicy(keep_warm_seconds=0.5))
    h.result("warm.state")
    wait_until(lambda: h.executor.warm.idle_count() == 0 and not sandbox_dirs(data_dir), timeout=30,
               message="the idle sandbox to be destroyed after --keep-warm")
    h2 = harness(driver, WarmPolicy(keep_warm_seconds=600))
    h2.result("warm.state")
    assert h2.executor.warm.idle_count() == 1 and sandbox_dirs(data_dir)
    h2.executor.close()
    assert not sandbox_dirs(data_dir) and not runsc_containers(data_dir)


# -- hibernation (gvisor) -------------------------------------------------------


@needs_runsc
def test_hibernation_round_trip(data_dir: Path, harness: Callable[..., Harness]) -> None:
    h = harness(GVisorDriver(data_dir), WarmPolicy(keep_warm_seconds=600, hibernate_after=0.5))
    secret = f"hibernated-secret-{os.getpid()}"
    first = h.result("warm.state", env={"TOKEN": secret})
    store = h.executor.store
    wait_until(lambda: len(store.hibernated()) == 1 and not sandbox_dirs(data_dir), timeout=60,
               message="the idle sandbox to be checkpointed to disk and destroyed")
    assert h.executor.warm.idle_count() == 0 and not runsc_containers(data_dir)
    ((tenant, image),) = store.hibernated()
    assert tenant == "acme"
    # the guest parent never read the tenant's secrets: the image holds none
    assert files_containing(image, [secret]) == []
    second = h.result("warm.state")
    assert [o for _, o in h.origins] == ["template", "hibernated"]
    assert second["boot"] == first["boot"] and second["warmups"] == 1 and second["env"] is None
    assert store.hibernated() == [] and not image.exists(), "a restored image is consumed"
    # another tenant never gets it
    h.result("warm.state", tenant="other")
    assert h.origins[-1][1] == "template"


@needs_runsc
def test_a_broken_template_is_dropped_and_batches_boot_cold(
        data_dir: Path, harness: Callable[..., Harness], caplog: pytest.LogCaptureFixture) -> None:
    h = harness(GVisorDriver(data_dir), WarmPolicy())
    h.result("warm.state")
    (template,) = h.executor.store.templates()
    for image_file in (p for p in template.image.rglob("*") if p.is_file()):
        image_file.write_bytes(b"not a checkpoint")
    with caplog.at_level(logging.WARNING, logger="tenantq.sandbox"):
        # the restore fails before the first job: nothing is reported, so the
        # dispatcher releases the job without using an attempt
        assert h.run("warm.state") == []
        after = h.result("warm.state")
    assert [o for _, o in h.origins] == ["template", "template", "cold"]
    assert after["warmups"] == 1
    assert h.executor.store.templates() == [], "the broken template was removed"
    assert any("snapshots off" in r.getMessage() for r in caplog.records)


def test_a_kept_sandbox_outlives_the_thread_that_made_it(
        driver: SandboxDriver, harness: Callable[..., Harness]) -> None:
    """Worker slots come and go (a --once slot ends when it finds no work);
    the sandboxes they kept warm must not go with them."""
    h = harness(driver, WarmPolicy(keep_warm_seconds=60))
    first: list[Any] = []
    maker = threading.Thread(target=lambda: first.append(h.result("warm.state")))
    maker.start()
    maker.join(timeout=120)
    assert first, "the first batch did not finish"
    # the thread is gone; the sandbox it made is still there for the next batch
    second = h.result("warm.state")
    (made, _), (reused, origin) = h.origins
    assert reused == made and origin == "warm" and second["boot"] == first[0]["boot"], h.origins
