"""Operations on stored records: status and dead letters, the catalog (show, export), forget,
rebuild from the mirrors, and reindex into a new Chroma collection."""
