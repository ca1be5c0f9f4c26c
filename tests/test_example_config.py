"""The shipped settings template names every setting and loads as the defaults."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import pytest
import yaml

from outbox import ConfigError, Settings, load_settings

TEMPLATE = Path(__file__).resolve().parent.parent / "outbox.example.yaml"


def test_template_lists_every_setting() -> None:
    names = set(yaml.safe_load(TEMPLATE.read_text(encoding="utf-8")))
    assert names == {field.name for field in fields(Settings)}


def test_template_values_equal_the_defaults(tmp_path: Path) -> None:
    loaded = {k: v for k, v in yaml.safe_load(TEMPLATE.read_text()).items() if v is not None}
    from_template = load_settings(env={"OUTBOX_CONFIG": str(TEMPLATE)})
    defaults = load_settings(env={})
    for name in loaded:
        assert getattr(from_template, name) == getattr(defaults, name), name


def test_a_custom_sink_whose_module_does_not_exist_is_refused_up_front() -> None:
    with pytest.raises(ConfigError, match=r"OUTBOX_SINKS.*no module of that name"):
        load_settings(env={"OUTBOX_SINKS": "chroma,no_such_package.sinks:Webhook"})
