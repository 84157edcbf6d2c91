"""The shop app: orders, whose receipts are sent by tenantq jobs."""
