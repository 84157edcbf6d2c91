"""Framework examples (FastAPI, Django, SQLAlchemy, psycopg), each run by tests/examples/."""
