"""The project's tenantq.Queue: one per process, on the database Django uses
(TENANTQ_SCHEMA names tenantq's schema in it; default `tenantq`)."""

from django.conf import settings

import tenantq

queue = tenantq.Queue(settings.DATABASE_URL)
