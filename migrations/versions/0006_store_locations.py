"""Where a store's mirrors live, recorded when the store is created.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01
"""

from __future__ import annotations

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Placeholder: filled in by the change that owns this revision."""


def downgrade() -> None:
    """Placeholder: filled in by the change that owns this revision."""
