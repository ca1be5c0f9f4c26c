"""The schema revision this code reads and writes, bumped with every migration.

Apart from the tables (``schema.py``) so that what only compares it, the open's check before
loading Alembic and ``outbox add``'s direct write, need not import SQLAlchemy.
"""

SCHEMA_REVISION = "0009"
