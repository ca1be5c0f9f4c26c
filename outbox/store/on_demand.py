"""A ``Storage`` built on first use, for a write that usually needs none.

``outbox add``'s direct write commits on the bare driver; only its rare paths (a duplicate's
delivered ids, a file name taken after the commit, a torn log) read through the SQLAlchemy
store, and its common path must not even import it. The writer and the mirrors take a
``Callable[[], Storage]``; this is the one that builds it when first called.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from outbox.core.config import Settings
    from outbox.store.storage import Storage


class StorageOnDemand:
    """``Storage.from_settings(settings)``, built by the first call (from any thread)."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._storage: Storage | None = None
        self._lock = threading.Lock()

    def __call__(self) -> Storage:
        with self._lock:
            if self._storage is None:
                from outbox.store.storage import Storage

                self._storage = Storage.from_settings(self._settings)
            return self._storage

    def close(self) -> None:
        """Close the store if it was built."""
        with self._lock:
            if self._storage is not None:
                self._storage.close()
