from django.apps import AppConfig  # type: ignore[import-untyped]


class TenantqConfig(AppConfig):  # type: ignore[misc]
    name = "tenantq.contrib.django"
    label = "tenantq"
    verbose_name = "tenantq"
