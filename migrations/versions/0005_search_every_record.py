"""The lexical search index covers every record again, delivered or not.

Recall's lexical leg now searches every record, so delivering a record to the vector sink no
longer removes its FTS5 row on SQLite. Rows removed before this revision are put back: one
pass that inserts only the records without a row, so running it twice changes nothing.
PostgreSQL's GIN index always covered every record: nothing to do there.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01
"""

from __future__ import annotations

from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        op.execute(
            "INSERT INTO records_fts(rowid, content) SELECT r.seq, r.content FROM records r "
            "WHERE NOT EXISTS (SELECT 1 FROM records_fts f WHERE f.rowid = r.seq)"
        )


def downgrade() -> None:
    """Nothing to undo: the rows put back are what the index held when records were new."""
