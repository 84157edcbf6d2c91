"""POST /orders writes an order and enqueues its receipt job in one
transaction; GET /orders/<id>/receipt waits for the job's result."""

import json
import uuid

from django.db import connection, transaction
from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_GET, require_POST

import tenantq
from shop.models import Order
from shop.queue import queue


class PaymentDeclined(Exception):
    pass


@csrf_exempt  # a JSON API (this example has no CSRF middleware either)
@require_POST
def create_order(request: HttpRequest) -> JsonResponse:
    try:
        data = json.loads(request.body)
        tenant, item, amount_cents = str(data["tenant"]), str(data["item"]), int(data["amount_cents"])
    except (ValueError, KeyError, TypeError):
        return JsonResponse({"detail": "expected a JSON object: tenant, item, amount_cents"}, status=400)
    try:
        with transaction.atomic():  # one transaction: the order and its receipt job
            order = Order.objects.create(tenant=tenant, item=item, amount_cents=amount_cents)
            order.receipt_job = queue.enqueue(
                tenant, "receipts.send", {"order_id": order.id},
                actor=request.headers.get("X-User"),
                meta={"request_id": request.headers.get("X-Request-ID") or uuid.uuid4().hex},
                conn=connection,
            )
            order.save(update_fields=["receipt_job"])
            if data.get("fail"):  # stands for any step after the enqueue that fails
                raise PaymentDeclined("payment declined")
    except PaymentDeclined as exc:
        # atomic() rolled back: no order, no job, no worker woken
        return JsonResponse({"detail": f"{exc}: nothing was saved"}, status=402)
    except tenantq.InvalidInput as exc:  # a bad tenant id, say: enqueue wrote nothing
        return JsonResponse({"detail": str(exc)}, status=422)
    # committed: the order and the job exist together, and a worker was woken
    return JsonResponse({"order_id": order.id, "job_id": order.receipt_job}, status=201)


@require_GET
def receipt(request: HttpRequest, order_id: int) -> JsonResponse:
    order = Order.objects.filter(pk=order_id).first()
    if order is None or order.receipt_job is None:
        return JsonResponse({"detail": f"no order {order_id}"}, status=404)
    try:
        timeout = min(max(float(request.GET.get("timeout", "10")), 0.0), 60.0)
    except ValueError:
        return JsonResponse({"detail": "timeout must be a number of seconds"}, status=400)
    try:
        job = queue.wait(order.receipt_job, timeout=timeout)  # blocks this request's thread
    except tenantq.WaitTimeout:
        return JsonResponse({"detail": f"the receipt is not ready after {timeout:g} s"}, status=504)
    if job.status != "done":
        return JsonResponse({"detail": f"the receipt job ended {job.status}: {job.last_error}"}, status=502)
    return JsonResponse({"order_id": order.id, "receipt": job.result})
