"""The handler: imports a model at module level, so it loads only in a
process where Django is set up (`manage.py tenantq_worker` does it)."""

from typing import Any

from django.db import close_old_connections, connection, transaction

import tenantq
from tests.apps.djsite.models import Note


@tenantq.handler("notes.stamp", isolation="inline", timeout=30)
def stamp(payload: dict[str, Any], ctx: tenantq.JobContext) -> dict[str, Any]:
    close_old_connections()
    try:
        with transaction.atomic():
            note = Note.objects.select_for_update().get(pk=payload["note_id"])
            note.stamped_by = ctx.job_id
            note.save(update_fields=["stamped_by"])
            with connection.cursor() as cur:
                cur.execute("SHOW search_path")
                search_path = cur.fetchone()[0]
        return {"note_id": note.id, "text": note.text, "search_path": search_path}
    finally:
        close_old_connections()
