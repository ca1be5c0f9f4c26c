"""Settings precedence (contract section 6): defaults < YAML file < environment < keywords."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from outbox import ConfigError, Outbox, Settings, load_settings
from tests.conftest import FAULTY

# Each setting with a distinct value per layer: (YAML value, environment value, keyword value,
# and how each should come out).
LAYERS: dict[str, tuple[Any, str, Any, tuple[Any, Any, Any]]] = {
    "batch_size": (10, "20", 30, (10, 20, 30)),
    "max_retries": (1, "2", 3, (1, 2, 3)),
    "busy_timeout": ("2s", "3", 4.5, (2.0, 3.0, 4.5)),
    "retention": ("1d", "2h", 60, (86400.0, 7200.0, 60.0)),
    "poll_interval": (0.5, "250", "1m", (0.5, 250.0, 60.0)),
    "min_content_length": (2, "3", 4, (2, 3, 4)),
    "markdown_dir": (
        "yaml-md",
        "env-md",
        "kw-md",
        (Path("yaml-md"), Path("env-md"), Path("kw-md")),
    ),
    "sinks": (
        ["brainlayer"],
        "brainlayer, chroma",
        FAULTY,
        (("brainlayer",), ("brainlayer", "chroma"), (FAULTY,)),
    ),
    "chroma_collection": ("yaml-coll", "env-coll", "kw-coll", ("yaml-coll", "env-coll", "kw-coll")),
    "synchronous": ("normal", "EXTRA", "normal", ("NORMAL", "EXTRA", "NORMAL")),
}


def shown(value: Any) -> Any:
    """A path setting as the test wrote it: loaded paths are absolute, rooted at the store's
    root, which is the working directory here (the store is ./.outbox)."""
    if isinstance(value, Path) and value.is_absolute() and value.is_relative_to(Path.cwd()):
        return value.relative_to(Path.cwd())
    return value


def write_yaml(path: Path, values: dict[str, Any]) -> None:
    import yaml

    path.write_text(yaml.safe_dump(values))


def test_defaults() -> None:
    s = load_settings(env={})
    root = Path.cwd()  # no .outbox here or above: a new store would go here
    assert s.home == root / ".outbox"
    assert s.db_url == f"sqlite:///{root}/.outbox/outbox.db"
    assert s.jsonl_path == root / ".outbox/outbox.jsonl"
    assert s.markdown_dir == root / "docs.local/decisions"
    assert s.sinks == ("chroma",)
    assert s.chroma_path == root / ".outbox/chroma"
    assert s.chroma_url is None
    assert s.chroma_mode == "server" and s.chroma_idle == 600.0
    assert s.chroma_collection == "agent-memory"
    assert s.brainlayer_db is None
    assert s.synchronous == "FULL"


@pytest.mark.parametrize("name", LAYERS)
def test_each_layer_overrides_the_one_below(tmp_path: Path, name: str) -> None:
    yaml_value, env_value, keyword_value, (from_yaml, from_env, from_keyword) = LAYERS[name]
    default = getattr(Settings(), name)
    assert default not in (from_yaml, from_env)
    assert from_keyword != from_env
    env_name = f"OUTBOX_{name.upper()}"

    assert shown(getattr(load_settings(env={}), name)) == default
    write_yaml(tmp_path / "outbox.yaml", {name: yaml_value})
    assert shown(getattr(load_settings(env={}), name)) == from_yaml
    assert shown(getattr(load_settings(env={env_name: env_value}), name)) == from_env
    kw = load_settings(env={env_name: env_value}, **{name: keyword_value})
    assert shown(getattr(kw, name)) == from_keyword


def test_all_layers_at_once_for_several_settings(tmp_path: Path) -> None:
    write_yaml(
        tmp_path / "outbox.yaml",
        {"batch_size": 10, "max_retries": 1, "busy_timeout": 2, "chroma_collection": "yaml-c"},
    )
    s = load_settings(
        env={
            "OUTBOX_MAX_RETRIES": "2",
            "OUTBOX_BUSY_TIMEOUT": "3",
            "OUTBOX_CHROMA_COLLECTION": "e-c",
        },
        busy_timeout=4,
    )
    assert (s.batch_size, s.max_retries, s.busy_timeout, s.chroma_collection) == (
        10,  # only the file sets it
        2,  # the environment beats the file
        4.0,  # the keyword beats both
        "e-c",
    )


def test_outbox_config_names_the_file_and_replaces_the_local_one(tmp_path: Path) -> None:
    write_yaml(tmp_path / "outbox.yaml", {"batch_size": 10, "max_retries": 7})
    elsewhere = tmp_path / "conf" / "other.yaml"
    elsewhere.parent.mkdir()
    write_yaml(elsewhere, {"batch_size": 99})
    s = load_settings(env={"OUTBOX_CONFIG": str(elsewhere)})
    assert s.batch_size == 99
    assert s.max_retries == Settings().max_retries  # ./outbox.yaml was not read


def test_an_empty_environment_value_does_not_override(tmp_path: Path) -> None:
    write_yaml(tmp_path / "outbox.yaml", {"batch_size": 10})
    assert load_settings(env={"OUTBOX_BATCH_SIZE": ""}).batch_size == 10


def test_home_moves_the_derived_defaults() -> None:
    s = load_settings(env={"OUTBOX_HOME": "/srv/memory"})
    assert s.db_url == "sqlite:////srv/memory/outbox.db"
    assert s.jsonl_path == Path("/srv/memory/outbox.jsonl")
    assert s.chroma_path == Path("/srv/memory/chroma")
    assert s.markdown_dir == Path("/srv/docs.local/decisions")  # against the store's root


CONTRACT_NAMES: dict[str, tuple[str, str, Any]] = {
    "OUTBOX_HOME": ("/data/ob", "home", Path("/data/ob")),
    "OUTBOX_DB_URL": ("sqlite:////data/x.db", "db_url", "sqlite:////data/x.db"),
    "OUTBOX_JSONL_PATH": ("/data/log.jsonl", "jsonl_path", Path("/data/log.jsonl")),
    "OUTBOX_MARKDOWN_DIR": ("notes/md", "markdown_dir", Path("notes/md")),
    "OUTBOX_SINKS": (
        "chroma,brainlayer,outbox.testing.sinks:NoopSink",
        "sinks",
        ("chroma", "brainlayer", "outbox.testing.sinks:NoopSink"),
    ),
    "OUTBOX_CHROMA_PATH": ("/data/chroma", "chroma_path", Path("/data/chroma")),
    "OUTBOX_CHROMA_URL": ("http://127.0.0.1:8000", "chroma_url", "http://127.0.0.1:8000"),
    "OUTBOX_CHROMA_COLLECTION": ("memories", "chroma_collection", "memories"),
    "OUTBOX_BRAINLAYER_DB": ("/data/brain.db", "brainlayer_db", Path("/data/brain.db")),
    "OUTBOX_MAX_RETRIES": ("4", "max_retries", 4),
    "OUTBOX_BATCH_SIZE": ("17", "batch_size", 17),
    "OUTBOX_POLL_INTERVAL": ("2.5", "poll_interval", 2.5),
    "OUTBOX_RETENTION": ("3d", "retention", 3 * 86400.0),
    "OUTBOX_MIN_CONTENT_LENGTH": ("12", "min_content_length", 12),
    "OUTBOX_BUSY_TIMEOUT": ("750", "busy_timeout", 750.0),
}


@pytest.mark.parametrize("variable", CONTRACT_NAMES)
def test_every_contract_name_is_recognised(variable: str) -> None:
    value, field, expected = CONTRACT_NAMES[variable]
    assert shown(getattr(load_settings(env={}), field)) != expected
    assert shown(getattr(load_settings(env={variable: value}), field)) == expected


@pytest.mark.parametrize("variable", CONTRACT_NAMES)
def test_every_contract_name_works_in_the_yaml_file(tmp_path: Path, variable: str) -> None:
    value, field, expected = CONTRACT_NAMES[variable]
    write_yaml(tmp_path / "outbox.yaml", {variable.removeprefix("OUTBOX_").lower(): value})
    assert shown(getattr(load_settings(env={}), field)) == expected


def test_outbox_open_uses_the_environment_and_keyword_overrides(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_yaml(tmp_path / "outbox.yaml", {"markdown_dir": "from-yaml", "sinks": "chroma"})
    monkeypatch.setenv("OUTBOX_SINKS", FAULTY)
    monkeypatch.setenv("OUTBOX_HOME", str(tmp_path / "env-home"))
    with Outbox.open(markdown_dir=tmp_path / "from-keyword") as ob:
        receipt = ob.add("where does this memory go", timestamp="2026-11-29T08:00:00Z")
    assert receipt.markdown_path is not None
    assert receipt.markdown_path.parent == tmp_path / "from-keyword"
    assert (tmp_path / "env-home" / "outbox.db").is_file()
    assert receipt.sinks == (FAULTY,)
    assert not (tmp_path / "from-yaml").exists()


def test_min_content_length_reaches_the_gate(tmp_path: Path) -> None:
    with Outbox.open(
        home=tmp_path / "h", markdown_dir=tmp_path / "m", sinks=FAULTY, min_content_length=12
    ) as ob:
        with pytest.raises(ValueError, match="OUTBOX_MIN_CONTENT_LENGTH"):
            ob.add("eleven char")
        assert not ob.add("twelve chars").duplicate


def test_first_bad_value_is_named() -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(env={"OUTBOX_BATCH_SIZE": "ten"})
    assert info.value.setting == "OUTBOX_BATCH_SIZE"
    assert "ten" in str(info.value)


def test_chroma_mode_and_idle_are_checked_and_named() -> None:
    assert load_settings(env={"OUTBOX_CHROMA_MODE": " Embedded "}).chroma_mode == "embedded"
    assert load_settings(env={"OUTBOX_CHROMA_IDLE": "0"}).chroma_idle == 0.0
    assert load_settings(env={"OUTBOX_CHROMA_IDLE": "2h"}).chroma_idle == 7200.0
    with pytest.raises(ConfigError, match=r"OUTBOX_CHROMA_MODE.*server, embedded"):
        load_settings(env={"OUTBOX_CHROMA_MODE": "persistent"})
    with pytest.raises(ConfigError, match="OUTBOX_CHROMA_IDLE"):
        load_settings(env={"OUTBOX_CHROMA_IDLE": "soon"})
    with pytest.raises(ConfigError, match=r"OUTBOX_CHROMA_MODE.*unset OUTBOX_CHROMA_URL"):
        load_settings(env={"OUTBOX_CHROMA_MODE": "embedded"}, chroma_url="http://127.0.0.1:1")


def test_the_store_is_found_from_any_folder_below_its_root(tmp_path: Path) -> None:
    """As git finds .git: a shell in a subfolder opens the same store, and relative paths
    resolve against the store's root, never the working directory."""
    (tmp_path / ".outbox").mkdir()
    below = tmp_path / "a" / "b"
    below.mkdir(parents=True)
    import os

    os.chdir(below)
    s = load_settings(env={"OUTBOX_MARKDOWN_DIR": "notes", "OUTBOX_DB_URL": "sqlite:///db/x.db"})
    assert s.home == tmp_path / ".outbox"
    assert s.markdown_dir == tmp_path / "notes"
    assert s.db_url == f"sqlite:///{tmp_path}/db/x.db"
    assert s.jsonl_path == tmp_path / ".outbox" / "outbox.jsonl"
