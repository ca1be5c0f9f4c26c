"""Remember the hash of the JSONL line the repair watermark ends on.

After a power loss the log can lose lines the watermark had counted, and a writer that skips
repair can then append new lines that end exactly at the remembered offset. The offset alone
looks intact then, and repair would never restore the lost lines. With the hash of the line
that ended there, repair notices that a different line ends there now and rescans.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("mirror_state", sa.Column("line_hash", sa.String(64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("mirror_state") as batch:
        batch.drop_column("line_hash")
