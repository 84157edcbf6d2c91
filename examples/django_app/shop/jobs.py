"""The handlers. `python manage.py tenantq_worker` runs them; so does a plain
`tenantq worker --app shop.jobs` started in this directory, for which this
module sets Django up itself."""

import os
from typing import Any

import django
from django.apps import apps

import tenantq

if not apps.ready:  # imported by `tenantq worker`, not by manage.py
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "mysite.settings")
    django.setup()


# isolation="inline": trusted first-party code that uses the project's database
# (a sandbox has no network, so it could not reach it)
@tenantq.handler("receipts.send", isolation="inline", timeout=30)
def send_receipt(payload: dict[str, Any], ctx: tenantq.JobContext) -> dict[str, Any]:
    from django.db import close_old_connections, transaction
    from django.utils import timezone

    from shop.models import Order

    close_old_connections()  # what Django does around each request, around each job
    try:
        with transaction.atomic():
            # the job exists only if the order's transaction committed: the order is there
            order = Order.objects.select_for_update().get(pk=payload["order_id"])
            if order.receipt_sent_at is None:  # at-least-once: a second run sends nothing
                order.receipt_sent_at = timezone.now()  # (a real app sends the e-mail here)
                order.save(update_fields=["receipt_sent_at"])
        return {
            "order_id": order.id,
            "to": ctx.actor,
            "request_id": ctx.meta.get("request_id"),
            "text": f"{order.item}: {order.amount_cents / 100:.2f}",
            "sent_at": order.receipt_sent_at.isoformat(),
        }
    finally:
        close_old_connections()
