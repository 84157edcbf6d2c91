"""Integrations with web frameworks (`tenantq.contrib.django`)."""
