"""A Django project and app in one package for tests/integration/test_contrib_django.py:
`tenantq.contrib.django` installed, a `Note` model, an inline handler that
uses the ORM (jobs.py) and the scenarios a child Python runs (scenarios.py)."""
