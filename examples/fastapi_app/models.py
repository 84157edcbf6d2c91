"""The app's own table and where its database is: shared by the web app (app.py)
and the handlers (jobs.py)."""

from __future__ import annotations

import os
from datetime import datetime

from sqlalchemy import BigInteger, DateTime, String, make_url
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

# The app's database, which also holds tenantq's schema: enqueue(conn=...)
# writes the job there, in the app's transaction. A libpq URL
# (postgresql://USER@HOST/DB); SQLAlchemy gets it with the psycopg 3 driver.
DATABASE_URL = os.environ.get("DATABASE_URL") or os.environ["TENANTQ_DATABASE_URL"]
SQLALCHEMY_URL = make_url(DATABASE_URL).set(drivername="postgresql+psycopg")


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "orders"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    tenant: Mapped[str] = mapped_column(String(64))
    item: Mapped[str] = mapped_column(String(200))
    amount_cents: Mapped[int]
    receipt_job: Mapped[int | None] = mapped_column(BigInteger)
    receipt_sent_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
