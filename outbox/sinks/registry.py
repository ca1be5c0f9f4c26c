"""Turn configured sink names into sink objects; heavy sink modules load only here."""

from __future__ import annotations

import importlib
from typing import Any

from outbox.config import Settings
from outbox.errors import ConfigError
from outbox.sinks.base import Sink


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
    elif callable(target) and not isinstance(target, Sink):
        sink = target(settings)
    else:
        sink = target
    if not isinstance(sink, Sink):
        raise ConfigError("OUTBOX_SINKS", f"{name!r} gives no object with deliver()/close()")
    sink.name = name
    return sink
