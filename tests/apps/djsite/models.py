from django.db import models


class Note(models.Model):
    tenant = models.CharField(max_length=64)
    text = models.CharField(max_length=200)
    job = models.BigIntegerField(null=True)  # the tenantq job enqueued with it
    stamped_by = models.BigIntegerField(null=True)  # the job that ran for it
