"""Dispatcher heartbeats: who is draining, from where, how fast.

One row per ``outbox run`` daemon, rewritten at every beat, so ``outbox status`` can tell a
dispatcher that is alive from one that died without stopping (no beat for longer than the
``gone_after`` it recorded itself).

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "dispatcher_heartbeats",
        sa.Column("owner", sa.String(255), primary_key=True),
        sa.Column("host", sa.String(255), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("sinks", sa.JSON(), nullable=False),
        sa.Column("started_at", sa.Float(), nullable=False),
        sa.Column("beat_at", sa.Float(), nullable=False),
        sa.Column("gone_after", sa.Float(), nullable=False),
        sa.Column("last_batch_at", sa.Float(), nullable=True),
        sa.Column("delivered", sa.BigInteger(), nullable=False),
        sa.Column("failed", sa.BigInteger(), nullable=False),
        sa.Column("records_per_second", sa.Float(), nullable=False),
        sa.Column("stopped_at", sa.Float(), nullable=True),
    )


def downgrade() -> None:
    op.drop_table("dispatcher_heartbeats")
