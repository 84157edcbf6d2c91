"""Small, runnable snippets that docs/using-from-your-app.md quotes; each is
run by tests/examples/test_snippets.py. They write to an `orders` table of
the app's own (tables.py) and enqueue in the same transaction."""
