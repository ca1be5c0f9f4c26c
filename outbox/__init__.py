"""outbox: the write path that AI-agent memory never loses.

``Outbox.open().add(text)`` commits the memory and its outbox rows in one transaction and
returns at once; a dispatcher delivers to Chroma and BrainLayer later, with retries.
"""

from outbox.api import Outbox
from outbox.config import Settings, load_settings
from outbox.errors import ConfigError, OutboxError, StoreFailed, ValidationError
from outbox.receipt import Receipt

__all__ = [
    "ConfigError",
    "Outbox",
    "OutboxError",
    "Receipt",
    "Settings",
    "StoreFailed",
    "ValidationError",
    "load_settings",
]
__version__ = "0.1.0"
