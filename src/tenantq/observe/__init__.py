"""Observability: Prometheus metrics, dead-letter alerts, log formats."""
