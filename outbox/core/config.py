"""Settings: defaults < YAML file < environment < keyword overrides (docs/configuration.md).

Every value is checked here, before anything opens a file, so a bad setting is one clear error
naming the setting and nothing is written.
"""

from __future__ import annotations

import os
import re
import shlex
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from outbox.core.errors import ConfigError

ENV_PREFIX = "OUTBOX_"
BUILTIN_SINKS = ("chroma", "brainlayer")
SYNCHRONOUS_MODES = ("FULL", "NORMAL", "EXTRA")
CHROMA_MODES = ("server", "embedded")
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")
_DURATION_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


@dataclass(frozen=True)
class Settings:
    """Resolved configuration. ``load_settings`` makes every path absolute: relative ones
    resolve against the store's root, the folder that holds ``home``."""

    home: Path = Path(".outbox")
    db_url: str = ""
    jsonl_path: Path = Path()
    markdown_dir: Path = Path("docs.local/decisions")
    sinks: tuple[str, ...] = ("chroma",)
    chroma_path: Path = Path()
    chroma_url: str | None = None
    chroma_mode: str = "server"
    chroma_idle: float = 600.0
    chroma_collection: str = "agent-memory"
    brainlayer_db: Path | None = None
    brainlayer_mcp: str | None = None
    embedding: str = "minilm"
    # ONNX threads of the embedder (0: the cores but one, so writers keep a core) and how far
    # ``outbox run`` and ``outbox drain`` lower their own CPU priority (a nice increment; 0
    # leaves it).
    embed_threads: int = 0
    run_nice: int = 10
    max_retries: int = 10
    batch_size: int = 64
    poll_interval: float = 1.0
    retention: float = 7 * 86400.0
    min_content_length: int = 1
    max_content_bytes: int = 1_048_576
    busy_timeout: float = 5.0
    synchronous: str = "FULL"
    lease_seconds: float = 60.0
    sink_timeout: float = 25.0
    # ``outbox run``'s heartbeat period, and the port of its Prometheus endpoint (0: none).
    heartbeat_interval: float = 5.0
    metrics_port: int = 0
    mirror_id: str = field(default_factory=socket.gethostname)


def _as_int(name: str, value: Any, minimum: int, maximum: int | None = None) -> int:
    if isinstance(value, bool):
        raise ConfigError(name, f"expected a whole number, got {value!r}")
    try:
        number = int(str(value).strip()) if not isinstance(value, int) else value
    except ValueError:
        raise ConfigError(name, f"expected a whole number, got {value!r}") from None
    if number < minimum or (maximum is not None and number > maximum):
        upper = f"..{maximum}" if maximum is not None else " or more"
        raise ConfigError(name, f"must be {minimum}{upper}, got {number}")
    return number


def _as_seconds(name: str, value: Any, minimum: float = 0.0) -> float:
    """Seconds, as a number or with a unit suffix: ``30``, ``2.5s``, ``10m``, ``12h``, ``7d``."""
    if isinstance(value, bool):
        raise ConfigError(name, f"expected a duration, got {value!r}")
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        match = _DURATION.match(str(value))
        if not match:
            raise ConfigError(
                name, f"expected seconds or a duration like 30s, 10m, 7d; got {value!r}"
            )
        seconds = float(match.group(1)) * _DURATION_UNITS[match.group(2)]
    if seconds < minimum or seconds != seconds:
        raise ConfigError(name, f"must be at least {minimum} seconds, got {value!r}")
    return seconds


def _module_exists(module: str) -> bool:
    """Whether a custom sink's module can be found, without importing the module itself
    (a sink may be heavy; only the dispatcher loads it)."""
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _as_sinks(value: Any) -> tuple[str, ...]:
    items = value if isinstance(value, list | tuple) else str(value).split(",")
    sinks: list[str] = []
    for item in items:
        name = str(item).strip()
        if not name:
            continue
        if name not in BUILTIN_SINKS and not re.fullmatch(r"[\w.]+:[\w.]+", name):
            raise ConfigError(
                "OUTBOX_SINKS", f"unknown sink {name!r} (use chroma, brainlayer or module:attr)"
            )
        if name not in BUILTIN_SINKS and not _module_exists(name.partition(":")[0]):
            raise ConfigError("OUTBOX_SINKS", f"sink {name!r}: no module of that name")
        if name not in sinks:
            sinks.append(name)
    if not sinks:
        raise ConfigError("OUTBOX_SINKS", "names no sink")
    return tuple(sinks)


def _read_yaml(path: Path) -> dict[str, Any]:
    import yaml

    try:
        loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError("OUTBOX_CONFIG", f"cannot read {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(
            "OUTBOX_CONFIG", f"{path} is not valid YAML ({exc.__class__.__name__})"
        ) from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError("OUTBOX_CONFIG", f"{path} must hold a mapping of settings")
    return loaded


_NAMES = {f.name for f in fields(Settings)}


def _gather(env: Mapping[str, str], overrides: Mapping[str, Any]) -> dict[str, tuple[str, Any]]:
    """Raw values with the name to blame for each: later sources win."""
    raw: dict[str, tuple[str, Any]] = {}
    config_path = env.get("OUTBOX_CONFIG")
    path = Path(config_path) if config_path else Path("outbox.yaml")
    if config_path or path.is_file():
        for key, value in _read_yaml(path).items():
            name = str(key).lower()
            if name not in _NAMES:
                raise ConfigError(f"{path}: {key}", "is not a setting (see outbox.example.yaml)")
            if value is None:  # an empty entry means "the default"
                continue
            raw[name] = (f"{ENV_PREFIX}{name.upper()} (from {path})", value)
    for name in _NAMES:
        env_name = ENV_PREFIX + name.upper()
        if env.get(env_name, "") != "":
            raw[name] = (env_name, env[env_name])
    for name, value in overrides.items():
        if name not in _NAMES:
            raise ConfigError(name, "is not a setting")
        if value is not None:
            raw[name] = (name, value)
    return raw


_PATHS = ("jsonl_path", "markdown_dir", "chroma_path", "brainlayer_db")
_TEXTS = ("db_url", "chroma_url", "chroma_collection", "brainlayer_mcp", "embedding", "mirror_id")
_INT_LIMITS = {
    "max_retries": (0, 1000),
    "batch_size": (1, 5000),
    "min_content_length": (1, 1_000_000),
    "max_content_bytes": (1, 64 * 1_048_576),
    "embed_threads": (0, 64),
    "run_nice": (0, 19),
    "metrics_port": (0, 65535),
}
_SECONDS_MINIMUM = {
    "poll_interval": 0.01,
    "retention": 0.0,
    "busy_timeout": 0.0,
    "lease_seconds": 1.0,
    "sink_timeout": 0.1,
    "chroma_idle": 0.0,
    "heartbeat_interval": 0.05,
}


def _typed(raw: dict[str, tuple[str, Any]]) -> dict[str, Any]:
    """Each given setting converted to its type; ConfigError names the first bad one."""
    values: dict[str, Any] = {}
    for name, (label, value) in raw.items():
        if name in _PATHS or name == "home":
            values[name] = Path(str(value))
        elif name in _TEXTS:
            values[name] = str(value).strip()
        elif name == "sinks":
            values[name] = _as_sinks(value)
        elif name in _INT_LIMITS:
            values[name] = _as_int(label, value, *_INT_LIMITS[name])
        elif name in _SECONDS_MINIMUM:
            values[name] = _as_seconds(label, value, _SECONDS_MINIMUM[name])
        elif name == "synchronous":
            mode = str(value).strip().upper()
            if mode not in SYNCHRONOUS_MODES:
                raise ConfigError(
                    label, f"must be one of {', '.join(SYNCHRONOUS_MODES)}, got {value!r}"
                )
            values[name] = mode
        elif name == "chroma_mode":
            values[name] = _as_choice(label, value, CHROMA_MODES)
    return values


def _as_choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    choice = str(value).strip().lower()
    if choice not in choices:
        raise ConfigError(name, f"must be one of {', '.join(choices)}, got {value!r}")
    return choice


def _check_texts(values: dict[str, Any]) -> None:
    """The text settings whose shape can be checked before anything is opened."""
    if "chroma_collection" in values and not re.fullmatch(
        r"[A-Za-z0-9][A-Za-z0-9._-]{1,510}[A-Za-z0-9]", values["chroma_collection"]
    ):
        raise ConfigError("OUTBOX_CHROMA_COLLECTION", "needs 3-512 characters from [A-Za-z0-9._-]")
    if values.get("embedding") and not re.fullmatch(
        r"minilm|hashing|[\w.]+:[\w.]+", values["embedding"]
    ):
        raise ConfigError(
            "OUTBOX_EMBEDDING", f"use minilm, hashing or module:attr, got {values['embedding']!r}"
        )
    if values.get("brainlayer_mcp"):
        try:
            argv = shlex.split(values["brainlayer_mcp"])
        except ValueError as exc:
            raise ConfigError("OUTBOX_BRAINLAYER_MCP", f"cannot split it ({exc})") from None
        if not argv or not argv[0]:
            raise ConfigError("OUTBOX_BRAINLAYER_MCP", "names no command")
    if values.get("chroma_url") and not re.match(r"^https?://[^/\s]+", values["chroma_url"]):
        raise ConfigError(
            "OUTBOX_CHROMA_URL", f"expected http://host:port, got {values['chroma_url']!r}"
        )


def load_settings(env: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
    """Resolve every setting; raise ConfigError naming the first bad one."""
    values = _typed(_gather(os.environ if env is None else env, overrides))
    _check_texts(values)
    settings = replace(Settings(), **values)
    if settings.chroma_url and settings.chroma_mode == "embedded":
        raise ConfigError(
            "OUTBOX_CHROMA_MODE", "embedded opens OUTBOX_CHROMA_PATH; unset OUTBOX_CHROMA_URL"
        )
    home = settings.home.absolute() if "home" in values else find_home(Path.cwd())
    _check_folder_setting("OUTBOX_HOME", home, "a folder")
    defaults: dict[str, Any] = {"home": home}
    if not settings.db_url:
        defaults["db_url"] = f"sqlite:///{home / 'outbox.db'}"
    elif not re.match(r"^(sqlite|postgresql)(\+\w+)?://", settings.db_url):
        raise ConfigError("OUTBOX_DB_URL", "expected a sqlite:/// or postgresql+psycopg:// URL")
    else:
        defaults["db_url"] = _rooted_url(settings.db_url, home.parent)
    if settings.jsonl_path == Path():
        defaults["jsonl_path"] = home / "outbox.jsonl"
    if settings.chroma_path == Path():
        defaults["chroma_path"] = home / "chroma"
    settings = replace(settings, **defaults)
    settings = replace(settings, **_rooted_paths(settings, home.parent))
    _check_folder_setting("OUTBOX_MARKDOWN_DIR", settings.markdown_dir, "a folder")
    _check_folder_setting("OUTBOX_JSONL_PATH", settings.jsonl_path.parent, "a file in a folder")
    return settings


def _check_folder_setting(setting: str, folder: Path, wanted: str) -> None:
    """A folder setting whose path, or a parent of it, is a file cannot become a folder:
    refused here, naming both, instead of every write going to the fallback queue."""
    for path in (folder, *folder.parents):
        if path.exists():
            if not path.is_dir():
                where = "is" if path == folder else f"is inside {path}, which is"
                raise ConfigError(
                    setting, f"{folder} {where} a file, not a folder; point {setting} at {wanted}"
                )
            return


def find_home(start: Path) -> Path:
    """The ``.outbox`` folder of ``start`` or of its nearest parent that has one (as git
    finds ``.git``), so every shell below a store's root opens the same store; else a new
    one in ``start``, created only by a command that writes."""
    for folder in (start, *start.parents):
        if (folder / ".outbox").is_dir():
            return folder / ".outbox"
    return start / ".outbox"


def _rooted_paths(settings: Settings, root: Path) -> dict[str, Any]:
    """Relative path settings against the store's root, never the working directory."""
    rooted: dict[str, Any] = {}
    for name in _PATHS:
        value = getattr(settings, name)
        if value is not None and not value.is_absolute():
            rooted[name] = root / value
    return rooted


def _rooted_url(db_url: str, root: Path) -> str:
    """A SQLite URL's relative file against the store's root (other URLs as they are)."""
    scheme, sep, rest = db_url.partition(":///")
    if not scheme.startswith("sqlite") or not sep or not rest or rest.startswith((":", "/")):
        return db_url
    return f"{scheme}:///{root / rest}"
