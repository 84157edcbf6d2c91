"""Warm starts without a sandbox: the policy's validation, the guest frame
format, template keys, snapshot garbage collection, registry warmups."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from tenantq.dispatch.executors.warm import WarmPolicy
from tenantq.errors import InvalidInput
from tenantq.guest.protocol import FrameFile as Frames
from tenantq.guest.protocol import encode as frame
from tenantq.registry import Registry, handler
from tenantq.sandbox.layout import GuestPython
from tenantq.sandbox.snapshots import SnapshotStore, template_key
from tenantq.sandbox.spec import SandboxSpec


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"keep_warm_seconds": -1}, "--keep-warm must be 0 or more"),
    ({"max_batches": 0}, "--max-batches-per-sandbox must be at least 1"),
    ({"keep_warm_seconds": 10, "hibernate_after": 10}, "--hibernate-after must be more than 0 and less"),
    ({"keep_warm_seconds": 0, "hibernate_after": 5}, "--hibernate-after must be more than 0 and less"),
])
def test_policy_refuses_nonsense(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(InvalidInput, match=message):
        WarmPolicy(**kwargs)  # type: ignore[arg-type]


def test_frames_round_trip_through_a_pipe_even_when_split() -> None:
    r, w = os.pipe()
    data = frame({"ttl": 30.0}) + frame({"TOKEN": "s" * 5000})
    # written in odd pieces: the reader must reassemble exact frames
    for i in range(0, len(data), 7):
        os.write(w, data[i:i + 7])
    os.close(w)
    frames = Frames(r)
    assert frames.read() == {"ttl": 30.0}
    assert frames.read() == {"TOKEN": "s" * 5000}
    assert frames.read() is None  # EOF: the dispatcher is gone
    os.close(r)


def test_frame_header_is_fixed_size() -> None:
    assert frame({}) == b"0000000002\n{}"


def _guest(code: Path, site: Path) -> GuestPython:
    return GuestPython("/usr/bin/python3", (), (), (str(site),), (str(code),))


def test_template_key_follows_code_dependencies_and_limits(tmp_path: Path) -> None:
    code, site = tmp_path / "app", tmp_path / "site-packages"
    code.mkdir()
    site.mkdir()
    (code / "__init__.py").write_text("X = 1\n")
    (site / "dep-1.0.dist-info").mkdir()
    spec = SandboxSpec(tenant="t", memory_mb=256)
    key = template_key("app", _guest(code, site), spec, "gvisor", "runsc 1")
    assert key == template_key("app", _guest(code, site), SandboxSpec(tenant="other", memory_mb=256),
                               "gvisor", "runsc 1"), "the tenant is not part of a template"
    (code / "__init__.py").write_text("X = 2\n")
    edited = template_key("app", _guest(code, site), spec, "gvisor", "runsc 1")
    assert edited != key
    (site / "dep-1.0.dist-info").rename(site / "dep-1.1.dist-info")
    upgraded = template_key("app", _guest(code, site), spec, "gvisor", "runsc 1")
    assert upgraded != edited
    assert template_key("app", _guest(code, site), SandboxSpec(tenant="t", memory_mb=512), "gvisor",
                        "runsc 1") != upgraded
    assert template_key("app", _guest(code, site), spec, "gvisor", "runsc 2") != upgraded


def _fake_template(store: SnapshotStore, key: str, app: str, created: float, used: float) -> None:
    def build(image: Path) -> None:
        image.mkdir()
        (image / "checkpoint.img").write_bytes(b"x" * 10)

    store.get_or_build(key, {"app": app}, build)
    meta_path = store.templates_dir / key / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["created"] = created
    meta_path.write_text(json.dumps(meta))
    (store.templates_dir / key / "used").touch()
    os.utime(store.templates_dir / key / "used", (used, used))


def test_gc_removes_idle_and_superseded_templates_but_never_current_ones(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path, "gvisor")
    now = time.time()
    _fake_template(store, "old", "app", created=now - 7200, used=now - 3600)
    _fake_template(store, "new", "app", created=now - 60, used=now - 60)
    _fake_template(store, "other", "other_app", created=now - 7200, used=now - 30)
    _fake_template(store, "ancient", "third", created=now - 3 * 86400, used=now - 2 * 86400)
    _fake_template(store, "pinned", "fourth", created=now - 3 * 86400, used=now - 2 * 86400)
    removed = store.gc(current={"pinned"}, now=now)
    assert sorted(removed) == ["template ancient", "template old"]
    assert sorted(t.key for t in store.templates()) == ["new", "other", "pinned"]


def test_get_or_build_builds_once_and_cleans_a_failed_build(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path, "gvisor")
    calls: list[Path] = []

    def failing(image: Path) -> None:
        image.mkdir()
        raise OSError("checkpoint exploded")

    with pytest.raises(OSError, match="exploded"):
        store.get_or_build("k", {"app": "a"}, failing)
    assert store.templates() == []
    assert [p for p in store.templates_dir.iterdir() if not p.name.endswith(".lock")] == []

    def ok(image: Path) -> None:
        calls.append(image)
        image.mkdir()

    first = store.get_or_build("k", {"app": "a"}, ok)
    second = store.get_or_build("k", {"app": "a"}, ok)
    assert len(calls) == 1 and first.key == second.key == "k"


def test_hibernated_images_are_per_tenant_and_taken_once(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path, "gvisor")
    store.get_or_build("k", {"app": "a"}, lambda image: image.mkdir())
    staging = store.hibernate_dir("..", "k")  # a tenant id that must never become a path
    (staging / "image").mkdir()
    store.commit_hibernated(staging, {"tenant": "..", "key": "k"})
    assert [t for t, _ in store.hibernated()] == [".."]
    assert store.take_hibernated("someone-else", "k") is None
    assert store.take_hibernated("..", "other-key") is None
    taken = store.take_hibernated("..", "k")
    assert taken is not None and taken.is_relative_to(store.hibernated_dir)
    assert store.take_hibernated("..", "k") is None, "an image is restored at most once"


def test_gc_drops_hibernated_images_of_a_removed_template(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path, "gvisor")
    store.get_or_build("k", {"app": "a"}, lambda image: image.mkdir())
    staging = store.hibernate_dir("acme", "k")
    (staging / "image").mkdir()
    store.commit_hibernated(staging, {"tenant": "acme", "key": "k"})
    assert store.gc(current={"k"}) == []
    store.remove("k")
    assert [r.split("/")[0] for r in store.gc()] == ["hibernated acme"]
    assert store.hibernated() == []


def test_registry_collects_warmups_and_resolves_them() -> None:
    registry = Registry()

    @handler("w.one", warmup="json:dumps", registry=registry)
    def one(payload: object, ctx: object) -> None: ...

    @handler("w.two", registry=registry)
    def two(payload: object, ctx: object) -> None: ...

    registry.add_warmup("app:level", lambda: None)
    assert registry.warmups() == ["json:dumps", "app:level"]
    assert registry.warmups(["w.two"]) == ["app:level"]
    assert registry.warmups(["w.one"]) == ["json:dumps", "app:level"]
    assert registry.resolve_warmup("json:dumps") is json.dumps
    with pytest.raises(InvalidInput, match=r"warmup 'nope\.module:f'"):
        registry.resolve_warmup("nope.module:f")


@pytest.mark.parametrize("name", ["nocolon", "mod:", ":func", "mod:not an identifier", "a..b:c"])
def test_handler_refuses_a_malformed_warmup_name(name: str) -> None:
    with pytest.raises(InvalidInput, match="warmup must be 'module:function'"):
        handler("w.bad", warmup=name, registry=Registry())
