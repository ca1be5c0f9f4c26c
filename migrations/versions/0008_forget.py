"""Forget: a record's content removed everywhere, its deletes queued for every sink.

``deliveries.op`` says whether a row delivers its record or deletes it from the sink;
``records.forgotten_at`` marks a tombstone and ``records.redaction_pending`` the forgets whose
mirrors (log redaction, markdown file) are not done yet. Existing rows are deliveries of live
records, which the server defaults say.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Plain ADD COLUMN on both databases: no table is rebuilt, however many rows it holds.
    op.add_column(
        "deliveries", sa.Column("op", sa.String(8), nullable=False, server_default="deliver")
    )
    op.add_column("records", sa.Column("forgotten_at", sa.Float(), nullable=True))
    op.add_column(
        "records",
        sa.Column("redaction_pending", sa.Integer(), nullable=False, server_default="0"),
    )
    op.create_index(
        "ix_records_redaction_pending",
        "records",
        ["seq"],
        sqlite_where=sa.text("redaction_pending > 0"),
        postgresql_where=sa.text("redaction_pending > 0"),
    )


def downgrade() -> None:
    op.drop_index("ix_records_redaction_pending", table_name="records")
    with op.batch_alter_table("records") as batch:
        batch.drop_column("redaction_pending")
        batch.drop_column("forgotten_at")
    with op.batch_alter_table("deliveries") as batch:
        batch.drop_column("op")
