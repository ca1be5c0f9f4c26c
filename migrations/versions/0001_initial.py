"""Initial schema: records, the recency graph, deliveries (the outbox), mirror state.

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

SeqType = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "records",
        sa.Column("seq", SeqType, primary_key=True, autoincrement=True),
        sa.Column("key", sa.String(64), nullable=False),
        sa.Column("ts", sa.String(32), nullable=False),
        sa.Column("content", sa.Text(), nullable=False),
        sa.Column("importance", sa.Integer(), nullable=False),
        sa.Column("tags", sa.JSON(), nullable=False),
        sa.Column("meta", sa.JSON(), nullable=False),
        sa.Column("slug", sa.String(128), nullable=False),
        sa.Column("markdown_name", sa.String(1024), nullable=False),
        sa.Column("origin", sa.String(255), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.UniqueConstraint("key"),
    )
    op.create_index("ix_records_origin_seq", "records", ["origin", "seq"])
    op.create_index("ix_records_markdown_name", "records", ["markdown_name"])

    graph_nodes = op.create_table(
        "graph_nodes",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("label", sa.String(64), nullable=False),
        sa.Column("session_id", sa.String(255)),
        sa.Column("agent", sa.String(255)),
        sa.Column("ts", sa.String(32)),
        sa.Column("properties", sa.JSON(), nullable=False),
    )
    op.create_index("ix_graph_nodes_label_ts", "graph_nodes", ["label", "ts", "id"])
    op.create_index("ix_graph_nodes_session_ts", "graph_nodes", ["session_id", "ts"])

    op.create_table(
        "graph_edges",
        sa.Column("id", SeqType, primary_key=True, autoincrement=True),
        sa.Column("source", sa.String(64), nullable=False),
        sa.Column("target", sa.String(64), nullable=False),
        sa.Column("type", sa.String(64), nullable=False),
        sa.Column("weight", sa.Float(), nullable=False),
        sa.Column("properties", sa.JSON(), nullable=False),
        sa.ForeignKeyConstraint(["source"], ["graph_nodes.id"], ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["target"], ["graph_nodes.id"], ondelete="CASCADE"),
        sa.UniqueConstraint("source", "target", "type", name="uq_graph_edges_source_target_type"),
    )
    op.create_index("ix_graph_edges_target", "graph_edges", ["target"])

    op.create_table(
        "deliveries",
        sa.Column("id", SeqType, primary_key=True, autoincrement=True),
        sa.Column("record_key", sa.String(64), nullable=False),
        sa.Column("sink", sa.String(255), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("available_at", sa.Float(), nullable=False),
        sa.Column("lease_owner", sa.String(255)),
        sa.Column("lease_expires_at", sa.Float()),
        sa.Column("last_error", sa.Text()),
        sa.Column("error_class", sa.String(32)),
        sa.Column("sink_id", sa.String(255)),
        sa.Column("mirror_pending", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("updated_at", sa.Float(), nullable=False),
        sa.Column("delivered_at", sa.Float()),
        sa.ForeignKeyConstraint(["record_key"], ["records.key"], ondelete="CASCADE"),
        sa.UniqueConstraint("record_key", "sink", name="uq_deliveries_record_sink"),
    )
    op.create_index("ix_deliveries_due", "deliveries", ["sink", "state", "available_at"])
    op.create_index(
        "ix_deliveries_mirror_pending",
        "deliveries",
        ["id"],
        sqlite_where=sa.text("mirror_pending = 1"),
        postgresql_where=sa.text("mirror_pending = 1"),
    )

    op.create_table(
        "mirror_state",
        sa.Column("mirror_id", sa.String(255), primary_key=True),
        sa.Column("record_seq", sa.BigInteger(), nullable=False),
        sa.Column("jsonl_offset", sa.BigInteger(), nullable=False),
        sa.Column("updated_at", sa.Float(), nullable=False),
    )

    op.bulk_insert(
        graph_nodes,
        [
            {
                "id": "frontier",
                "label": "SYSTEM_ANCHOR",
                "session_id": None,
                "agent": None,
                "ts": None,
                "properties": {
                    "name": "Active Context Frontier",
                    "description": "The anchor every new memory is linked from.",
                },
            }
        ],
    )


def downgrade() -> None:
    op.drop_table("mirror_state")
    op.drop_index("ix_deliveries_mirror_pending", table_name="deliveries")
    op.drop_index("ix_deliveries_due", table_name="deliveries")
    op.drop_table("deliveries")
    op.drop_index("ix_graph_edges_target", table_name="graph_edges")
    op.drop_table("graph_edges")
    op.drop_index("ix_graph_nodes_session_ts", table_name="graph_nodes")
    op.drop_index("ix_graph_nodes_label_ts", table_name="graph_nodes")
    op.drop_table("graph_nodes")
    op.drop_index("ix_records_markdown_name", table_name="records")
    op.drop_index("ix_records_origin_seq", table_name="records")
    op.drop_table("records")
