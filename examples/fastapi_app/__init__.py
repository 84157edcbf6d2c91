"""A FastAPI app that writes an order and enqueues its receipt job in one transaction (README.md)."""
