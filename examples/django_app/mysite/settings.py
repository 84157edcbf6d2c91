"""Settings of the example project: the database from DATABASE_URL (or
TENANTQ_DATABASE_URL), the same database that holds tenantq's schema."""

import os
from urllib.parse import parse_qsl, unquote, urlsplit

# A libpq URL: postgresql://USER[:PASSWORD]@HOST[:PORT]/DB[?options=...]. Its
# query parameters become connection options (e.g. options=-c search_path=shop).
DATABASE_URL = os.environ.get("DATABASE_URL") or os.environ["TENANTQ_DATABASE_URL"]
_url = urlsplit(DATABASE_URL)

DATABASES = {
    "default": {
        # on psycopg 3, which Django 4.2+ uses when it is installed: tenantq needs it
        "ENGINE": "django.db.backends.postgresql",
        "NAME": unquote(_url.path.lstrip("/")),
        "USER": unquote(_url.username or ""),
        "PASSWORD": unquote(_url.password or ""),
        "HOST": _url.hostname or "",
        "PORT": str(_url.port or ""),
        "OPTIONS": dict(parse_qsl(_url.query)),
    }
}

# the module whose @tenantq.handler functions `manage.py tenantq_worker` runs
# (when no --app is given); its database is DATABASES["default"] unless
# TENANTQ_DATABASE_URL is set
TENANTQ_APP = "shop.jobs"

SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "only-for-this-example")
DEBUG = os.environ.get("DJANGO_DEBUG") == "1"
ALLOWED_HOSTS = ["127.0.0.1", "localhost"]
INSTALLED_APPS = [
    "tenantq.contrib.django",  # manage.py tenantq_worker, manage.py tenantq_migrate
    "shop",
]
MIDDLEWARE: list[str] = []
ROOT_URLCONF = "mysite.urls"
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
