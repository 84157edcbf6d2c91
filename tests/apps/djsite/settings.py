"""DATABASES from DJSITE_DSN (the test server), the app's tables in
DJSITE_SCHEMA (its connections' search_path); DJSITE_PORT overrides the port."""

import os

from psycopg.conninfo import conninfo_to_dict

_params = conninfo_to_dict(os.environ["DJSITE_DSN"])

DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": _params.get("dbname") or "postgres",
        "USER": _params.get("user") or "",
        "PASSWORD": _params.get("password") or "",
        "HOST": _params.get("host") or "",
        "PORT": os.environ.get("DJSITE_PORT") or str(_params.get("port") or ""),
        "OPTIONS": {"options": f"-c search_path={os.environ['DJSITE_SCHEMA']}"},
    }
}
INSTALLED_APPS = ["tenantq.contrib.django", "tests.apps.djsite"]
TENANTQ_APP = "tests.apps.djsite.jobs"
SECRET_KEY = "only-for-tests"
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
