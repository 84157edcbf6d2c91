"""`python -m tenantq.cli ...`: the same as `tenantq ...`."""

from tenantq.cli import main

main()
