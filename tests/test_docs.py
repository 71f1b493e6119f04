"""Every drop field and every built-in plugin is documented (docs/drops.md, docs/plugins.md)."""

from __future__ import annotations

import tomllib

from tests._docs import page
from tests.conftest import REPO
from tuner.question.drop import DROP_FIELDS
from tuner.model.plugin import builtin_entry_points, load_registry


def test_every_drop_field_is_in_the_readme():
    drops = page("drops.md")
    missing = [f.name for f in DROP_FIELDS if f"`{f.name}`" not in drops]
    assert missing == []


def test_every_plugin_is_documented():
    readme = page("plugins.md")
    reg = load_registry(loader=builtin_entry_points)
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["entry-points"]["tuner.plugins"]
    assert reg.errors == [] and sorted(p.name for p in reg.plugins) == sorted(declared)  # every built-in, only those
    for p in reg.plugins:
        assert f"`{p.name}`" in readme
        assert (type(p).__doc__ or "").strip(), p.name
        assert (type(p).__module__ and __import__(type(p).__module__, fromlist=["x"]).__doc__ or "").strip()


def _install_undocumented_plugin(site):
    """A third-party distribution in ``site`` (an installed module and its ``.dist-info``, as pip
    lays them out) whose plugin the docs do not mention and whose module has no docstring."""
    (site / "someone_elses_plugin.py").write_text(
        "class P:\n    name = 'someone_elses_family'\n    architectures = ('SomeoneElsesForCausalLM',)\n"
        "    def kv_cache_spec(self, spec, settings):\n        return {}\n"
        "    def build_model(self, spec, settings):\n        return None\n"
        "    def weights_bytes(self, spec, settings, module):\n        return 0\n"
        "plugin = P()\n")
    info = site / "someone_elses_plugin-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: someone-elses-plugin\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[tuner.plugins]\nsomeone_elses_family = someone_elses_plugin:plugin\n")


def test_installed_third_party_plugin_breaks_the_docs_test(tmp_path, monkeypatch):
    _install_undocumented_plugin(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    # the trap is armed: the registry sees the third-party plugin, which docs/plugins.md does not name
    names = [p.name for p in load_registry().plugins]
    assert "someone_elses_family" in names and "generic" in names
    assert "`someone_elses_family`" not in page("plugins.md")
    assert "someone_elses_family" not in [p.name for p in load_registry(loader=builtin_entry_points).plugins]
    test_every_plugin_is_documented()  # checks the built-in plugins only
