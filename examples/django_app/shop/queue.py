"""The project's tenantq.Queue: one per process, on the database Django uses
(TENANTQ_DATABASE_URL when it is set, else DATABASES["default"];
TENANTQ_SCHEMA names tenantq's schema in it, default `tenantq`)."""

from tenantq.contrib.django import get_queue

queue = get_queue()
