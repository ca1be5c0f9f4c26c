"""The exceptions a caller can meet, each carrying one line that names what is wrong."""

from __future__ import annotations


class OutboxError(Exception):
    """Base of every error this library raises on purpose."""


class ValidationError(OutboxError, ValueError):
    """Input rejected before anything was written (CLI exit 2)."""

    def __init__(self, field: str, problem: str) -> None:
        self.field = field
        self.problem = problem
        super().__init__(f"invalid {field}: {problem}")


class ConfigError(OutboxError, ValueError):
    """A setting has a value the library cannot use; raised before any write."""

    def __init__(self, setting: str, problem: str) -> None:
        self.setting = setting
        super().__init__(f"bad setting {setting}: {problem}")


class StoreFailed(OutboxError):
    """Neither the database nor the fallback file took the write (CLI exit 1)."""


class MirrorBusy(OutboxError):
    """The mirror lock could not be taken within the write's time bound."""


class DatabaseTimeout(OutboxError):
    """The database server did not answer within the write's time bound (a server that
    stopped answering: the driver itself would wait for its reply forever)."""
