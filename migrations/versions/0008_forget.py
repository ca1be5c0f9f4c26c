"""Forget: a record's content removed everywhere, its deletes queued for every sink.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01
"""

from __future__ import annotations

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Placeholder: filled in by the change that owns this revision."""


def downgrade() -> None:
    """Placeholder: filled in by the change that owns this revision."""
