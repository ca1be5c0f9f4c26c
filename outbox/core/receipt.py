"""What a write returns, and the only words the library uses to describe it.

``stored`` appears only with a concrete id from a sink; everything else is ``queued`` or
``fallback``, whose texts say where the memory actually is.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from outbox.core.states import BuiltinSink, ReceiptStatus

_DISPLAY: dict[str, str] = {BuiltinSink.CHROMA: "Chroma", BuiltinSink.BRAINLAYER: "BrainLayer"}


def display_name(sink: str) -> str:
    """``Chroma``, ``BrainLayer``, or the attribute name of a custom ``module:attr`` sink."""
    if sink in _DISPLAY:
        return _DISPLAY[sink]
    return sink.rsplit(":", 1)[-1]


@dataclass(frozen=True)
class Receipt:
    key: str
    status: ReceiptStatus
    duplicate: bool
    markdown_path: Path | None
    timestamp: str
    sinks: tuple[str, ...] = ()
    sink_ids: Mapping[str, str] = field(default_factory=dict)
    reason: str | None = None

    @property
    def text(self) -> str:
        if self.status == ReceiptStatus.STORED:
            return "; ".join(
                f"Stored in {display_name(sink)}: {self.sink_ids[sink]}"
                for sink in self.sinks
                if sink in self.sink_ids
            )
        if self.status == ReceiptStatus.FALLBACK:
            pending = ", ".join(display_name(sink) for sink in self.sinks) or "outbox"
            return f"Queued to {self.markdown_path} pending {pending} recovery"
        waiting = [display_name(s) for s in self.sinks if s not in self.sink_ids]
        return f"Queued {self.key} for {', '.join(waiting) or 'no sink'}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "status": str(self.status),
            "duplicate": self.duplicate,
            "markdown_path": str(self.markdown_path) if self.markdown_path else None,
            "timestamp": self.timestamp,
            "sinks": list(self.sinks),
            "sink_ids": dict(self.sink_ids),
            "reason": self.reason,
            "text": self.text,
        }


def store_failed_text(sinks: tuple[str, ...]) -> str:
    """The one sentence for when neither the database nor the fallback file took a write."""
    names = ", ".join(display_name(sink) for sink in sinks) or "Outbox"
    return f"{names} store failed and fallback write failed"
