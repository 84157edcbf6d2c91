"""What a child Python does on the Django side (DJANGO_SETTINGS_MODULE is
tests.apps.djsite.settings): `python -c "from tests.apps.djsite.scenarios
import main; main()" NAME ARGS_JSON`; the last stdout line is the result as JSON."""

from __future__ import annotations

import json
import sys
from typing import Any

import django


class Rollback(Exception):
    pass


def _write_and_enqueue(tenant: str, text: str, *, fail: bool = False) -> dict[str, Any]:
    from django.db import connection, transaction

    from tenantq.contrib.django import get_queue
    from tests.apps.djsite.models import Note

    done: dict[str, Any] = {}
    try:
        with transaction.atomic():  # the note and its job: both committed, or neither
            note = Note.objects.create(tenant=tenant, text=text)
            note.job = get_queue().enqueue(tenant, "notes.stamp", {"note_id": note.id}, conn=connection)
            note.save(update_fields=["job"])
            done = {"note_id": note.id, "job_id": note.job}
            if fail:
                raise Rollback
    except Rollback:
        done["rolled_back"] = True
    return done


def enqueue(tenant: str) -> dict[str, Any]:
    return {"kept": _write_and_enqueue(tenant, "kept"),
            "dropped": _write_and_enqueue(tenant, "dropped", fail=True)}


def call_command_once(tenant: str) -> dict[str, Any]:
    from django.core.management import call_command

    from tenantq.contrib.django import get_queue
    from tests.apps.djsite.models import Note

    kept = _write_and_enqueue(tenant, "in-process")
    call_command("tenantq_worker", "--once", "--sandbox", "inline", "--concurrency", "1")
    job = get_queue().job(kept["job_id"])
    note = Note.objects.get(pk=kept["note_id"])
    return {**kept, "status": job.status, "result": job.result, "stamped_by": note.stamped_by}


def dsn() -> dict[str, Any]:
    from tenantq.contrib.django import database_url, django_dsn

    return {"django_dsn": django_dsn(), "database_url": database_url()}


def main() -> None:
    django.setup()
    name, args = sys.argv[1], json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    try:
        result = {"enqueue": enqueue, "call_command_once": call_command_once, "dsn": dsn}[name](**args)
    finally:
        from django.db import connections

        from tenantq.contrib.django import get_queue

        get_queue().close()
        connections.close_all()
    print(json.dumps(result))
