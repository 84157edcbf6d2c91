from django.db import models


class Order(models.Model):
    tenant = models.CharField(max_length=64)
    item = models.CharField(max_length=200)
    amount_cents = models.PositiveIntegerField()
    receipt_job = models.BigIntegerField(null=True)  # the tenantq job that sends its receipt
    receipt_sent_at = models.DateTimeField(null=True)
