"""tenantq benchmarks: `python -m bench [name ...]` (or `./run bench`)."""
