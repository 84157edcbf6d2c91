"""The app's own table the snippets write to (a real app has migrations)."""

ORDERS = """
CREATE TABLE IF NOT EXISTS orders (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    tenant text NOT NULL,
    item text NOT NULL
)
"""
