"""The guest side: what runs inside a sandbox. Stdlib only."""
