"""Full-text index over record content, for the pending overlay of semantic recall.

On SQLite an FTS5 table (rowid = the record's seq), kept in the write's own transaction; on
PostgreSQL a GIN index over to_tsvector. Rows leave the SQLite index once the vector sink
holds them, so the overlay only ever searches what the vector index lacks.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29
"""

from __future__ import annotations

from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    dialect = op.get_bind().dialect.name
    if dialect == "sqlite":
        # Its own copy of the text, not external content: rows are deleted when the vector
        # sink holds them, and deleting a row FTS5 no longer has must be a harmless no-op
        # (with external content it corrupts the index). The copy is bounded by the backlog.
        op.execute(
            "CREATE VIRTUAL TABLE records_fts USING fts5("
            "content, tokenize='porter unicode61 remove_diacritics 2')"
        )
        op.execute("INSERT INTO records_fts(rowid, content) SELECT seq, content FROM records")
    elif dialect == "postgresql":
        op.execute(
            "CREATE INDEX ix_records_content_fts ON records "
            "USING gin (to_tsvector('simple', content))"
        )


def downgrade() -> None:
    dialect = op.get_bind().dialect.name
    if dialect == "sqlite":
        op.execute("DROP TABLE records_fts")
    elif dialect == "postgresql":
        op.execute("DROP INDEX ix_records_content_fts")
