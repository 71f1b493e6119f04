"""Every drop field and every installed plugin is documented in the README."""

from __future__ import annotations

from tests.conftest import REPO
from tuner.drop import DROP_FIELDS
from tuner.plugin import load_registry


def test_every_drop_field_is_in_the_readme():
    readme = (REPO / "README.md").read_text()
    missing = [f.name for f in DROP_FIELDS if f"`{f.name}`" not in readme]
    assert missing == []


def test_every_plugin_is_documented():
    readme = (REPO / "README.md").read_text()
    for p in load_registry().plugins:
        assert f"`{p.name}`" in readme
        assert (type(p).__doc__ or "").strip(), p.name
        assert (type(p).__module__ and __import__(type(p).__module__, fromlist=["x"]).__doc__ or "").strip()
