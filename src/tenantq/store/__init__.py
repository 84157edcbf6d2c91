"""The store: Postgres tables and the SQL that reads and writes them."""
