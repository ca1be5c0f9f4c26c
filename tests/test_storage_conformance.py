"""One storage contract, two backends: the shipped suite on a SQLite file, then PostgreSQL.

The tests themselves live in ``outbox.testing.storage``; a dialect difference shows up here as
a failing test instead of a lost or doubled memory in production. The tests of the outbox on
both backends (writes, dispatchers, PostgreSQL's own settings) are in ``test_backends.py``.
"""

from __future__ import annotations

import pytest

from outbox import Outbox
from outbox.store.storage import Storage
from outbox.testing.storage import StorageConformance


class TestStorageSQLiteAndPostgres(StorageConformance):
    @pytest.fixture
    def storage(self, either_backend: Outbox) -> Storage:
        return either_backend.storage
