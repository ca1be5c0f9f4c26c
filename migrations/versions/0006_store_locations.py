"""Where a store's mirrors live, recorded when the store is created.

One row per machine that keeps mirrors (``mirror_id``: several machines may share one
PostgreSQL database, each with its own log and markdown folder). A store created before this
revision has no row: its next open records the paths it is opened with, and from then on an
open pointing elsewhere is refused.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "store_locations",
        sa.Column("mirror_id", sa.String(255), primary_key=True),
        sa.Column("jsonl_path", sa.Text(), nullable=False),
        sa.Column("markdown_dir", sa.Text(), nullable=False),
        sa.Column("recorded_at", sa.Float(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("store_locations")
