"""Turn configured sink names into sink objects; heavy sink modules load only here."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import Any, cast

from outbox.core.config import Settings
from outbox.core.errors import ConfigError
from outbox.sinks.base import DeleteOutcome, Held, Permanent, Sink


def _has_sink_methods(target: object) -> bool:
    return callable(getattr(target, "deliver", None)) and callable(getattr(target, "close", None))


def adopt(sink: object, name: str) -> Sink:
    """``sink`` under its configured ``name``, with ``semantic = False`` when it does not say
    (only a vector index may let the lexical overlay drop records)."""
    if not _has_sink_methods(sink):
        raise ConfigError("OUTBOX_SINKS", f"{name!r} gives no object with deliver()/close()")
    semantic = getattr(sink, "semantic", False)
    if not isinstance(semantic, bool):
        sink.semantic = bool(semantic)  # type: ignore[attr-defined]
    elif not hasattr(sink, "semantic"):
        sink.semantic = False  # type: ignore[attr-defined]
    sink.name = name  # type: ignore[attr-defined]
    if not callable(getattr(sink, "delete", None)):
        sink.delete = _cannot_delete(name)  # type: ignore[attr-defined]
    return cast(Sink, sink)


def _cannot_delete(name: str) -> Callable[[Sequence[Held]], list[DeleteOutcome]]:
    """A sink written before forget existed: its deletes become dead letters that say so,
    rather than a forget that silently leaves the record in it."""

    def delete(items: Sequence[Held]) -> list[DeleteOutcome]:
        raise Permanent(
            f"sink {name!r} has no delete(items); remove these records from it by hand, then "
            "`outbox dead discard`",
            "rejected",
        )

    return delete


def load_sink(name: str, settings: Settings) -> Sink:
    """``chroma``, ``brainlayer`` or ``module:attr``: a class with ``from_settings``, a
    factory called with the settings, or a ready sink object."""
    if name == "chroma":
        from outbox.sinks.chroma import ChromaSink

        return ChromaSink.from_settings(settings)
    if name == "brainlayer":
        from outbox.sinks.brainlayer import BrainLayerSink

        return BrainLayerSink.from_settings(settings)
    module_name, _, attr = name.partition(":")
    try:
        target: Any = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError("OUTBOX_SINKS", f"cannot load sink {name!r}: {exc}") from None
    if hasattr(target, "from_settings"):
        sink = target.from_settings(settings)
    elif isinstance(target, type) or (callable(target) and not _has_sink_methods(target)):
        sink = target(settings)
    else:
        sink = target
    return adopt(sink, name)
