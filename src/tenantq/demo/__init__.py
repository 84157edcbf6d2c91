"""The README's demo: several tenants, one of them a whale, drained fairly."""
