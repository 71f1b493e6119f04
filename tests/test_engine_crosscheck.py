"""The engine adapter's pure parts (no vLLM needed): vLLM spec objects converted to tuner.memory.kvcache
specs, plugin vs engine comparison, the decisions of tuner.engine.use with a stand-in session, and
term sources stored (migration 0005) and shown by explain."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from tuner.memory import kvcache
from tuner.engine import crosscheck
from tuner.engine.use import EnginePlugin, engine_for_job, gpu_block_size, verify_proposals
from tuner.memory.eras import era_for
from tuner.errors import EngineError


def _vllm(cls_name: str, **attrs):
    """A stand-in object whose class is named like vLLM's spec class."""
    return type(cls_name, (SimpleNamespace,), {})(**attrs)


def test_to_tuner_spec_keeps_pages():
    full = _vllm("FullAttentionSpec", block_size=16, num_kv_heads=8, head_size=128, dtype="torch.bfloat16",
                 head_size_v=128, sliding_window=None, attention_chunk_size=None, page_size_padded=None)
    t = crosscheck.to_tuner_spec(full)
    assert isinstance(t, kvcache.FullAttentionSpec) and t.page_size_bytes == 16 * 8 * 256 * 2 == 65536
    sw = crosscheck.to_tuner_spec(_vllm("SlidingWindowSpec", block_size=16, num_kv_heads=8, head_size=64,
                                        dtype="torch.bfloat16", sliding_window=128, page_size_padded=None))
    assert isinstance(sw, kvcache.SlidingWindowSpec) and sw.sliding_window == 128 and sw.page_size_bytes == 32768
    mla = crosscheck.to_tuner_spec(_vllm("MLAAttentionSpec", block_size=16, num_kv_heads=1, head_size=576,
                                         dtype="torch.bfloat16", cache_dtype_str="auto", page_size_padded=None))
    assert isinstance(mla, kvcache.MLAAttentionSpec) and mla.page_size_bytes == 18432
    mamba = crosscheck.to_tuner_spec(_vllm("MambaSpec", block_size=4128, shapes=((3, 20480), (256, 64, 256)),
                                           dtypes=("torch.bfloat16", "torch.float32"), page_size_padded=4128 * 4096,
                                           num_speculative_blocks=0))
    assert mamba.unpadded_page_size_bytes == 3 * 20480 * 2 + 256 * 64 * 256 * 4
    assert mamba.page_size_bytes == 4128 * 4096
    with pytest.raises(crosscheck.UnconvertibleSpec):
        crosscheck.to_tuner_spec(_vllm("CrossAttentionSpec", block_size=16))


def _full(n: int, heads: int = 8, bs: int = 16) -> dict:
    return {f"model.layers.{i}.self_attn.attn": kvcache.FullAttentionSpec(bs, heads, 128, 2) for i in range(n)}


def test_compare_agrees_and_finds_the_difference():
    same = crosscheck.compare(_full(32), _full(32), version="0.32.0", reference_bytes=40 << 30, block_size=16,
                              max_num_batched_tokens=8192)
    assert same["agree"] is True and same["differences"] == []
    assert same["engine"]["num_gpu_blocks"] == (40 << 30) // (32 * 65536) == 20480
    diff = crosscheck.compare(_full(32, heads=4), _full(32), version="0.32.0", reference_bytes=40 << 30,
                              block_size=16, max_num_batched_tokens=8192)
    assert diff["agree"] is False
    assert "num_gpu_blocks: plugin 40960, engine 20480" in diff["differences"]
    assert diff["differences"][0].startswith("layers by (kind, block_size, page bytes): plugin 32×FullAttentionSpec(bs 16, page 32768)")


class _Session:
    """Stands in for tuner.engine.adapter.EngineSession."""

    def __init__(self, version: str, specs: dict, weights: int = 123) -> None:
        self.version, self._specs, self._w = version, specs, weights
        self.timings, self.notes = {"import_s": 1.0}, []
        self.sized: list = []

    def config_report(self) -> dict:
        return {"platform": "cpu", "max_model_len": 4096}

    def kv_cache_specs(self) -> dict:
        return self._specs

    def weights(self) -> dict:
        return {"bytes": self._w, "by_dtype": {"bfloat16": self._w}, "params": self._w // 2}

    def kv_sizing(self, available: int, m: int) -> dict:
        self.sized.append((available, m))
        return {"starts": True, "num_gpu_blocks": available // (32 * 65536)}


def _vllm_specs(n: int, heads: int = 8) -> dict:
    return {f"model.layers.{i}.self_attn.attn": _vllm(
        "FullAttentionSpec", block_size=16, num_kv_heads=heads, head_size=128, dtype="torch.bfloat16",
        head_size_v=128, sliding_window=None, attention_chunk_size=None, page_size_padded=None) for i in range(n)}


def _use(session, *, unserved=False, plugin_specs=None, version="0.32.0", at=None):
    spec = SimpleNamespace(top={}, architectures=["XForCausalLM"])
    plugin = SimpleNamespace(name="generic", config_defaults=lambda top: {},
                             kv_cache_spec=lambda spec, s: plugin_specs, build_model=None)
    return engine_for_job(d={"engine_version": version, "path": "/d.yaml"}, model_dir="/m", spec=spec, plugin=plugin,
                          unserved=unserved, era=era_for(version), plugin_specs=plugin_specs,
                          plugin_specs_at=at or (lambda v: plugin_specs), reference_bytes=40 << 30,
                          opener=lambda *a, **k: session)


def test_same_release_disagreement_uses_the_engine_specs():
    use = _use(_Session("0.32.0", _vllm_specs(32)), plugin_specs=_full(32, heads=4))
    assert use.report["releases_match"] is True and use.report["decision"] == "engine (plugin disagrees)"
    assert use.kv_specs is not None and next(iter(use.kv_specs.values())).num_kv_heads == 8
    assert any("disagree" in w for w in use.warnings)


def test_other_release_compares_the_plugin_at_the_installed_release():
    seen = []

    def at(version):
        seen.append(version)
        return _full(32)

    use = _use(_Session("0.32.0", _vllm_specs(32)), plugin_specs=_full(32, heads=4), version="0.19.0", at=at)
    assert seen == ["0.32.0"] and use.report["check"]["agree"] is True and use.kv_specs is None
    assert use.report["decision"].startswith("plugin at 0.19.0")
    assert any("differs from the drop's engine_version 0.19.0" in w for w in use.warnings)


def test_unserved_architecture_is_served_by_the_engine():
    use = _use(_Session("0.32.0", _vllm_specs(4), weights=42_517_568), unserved=True)
    assert isinstance(use.plugin, EnginePlugin) and use.weights and use.trace_activation
    assert not use.approximate_activation  # until a trace cannot run (EngineUse.run_pass)
    assert use.plugin.weights_bytes(None, None, None) == 42_517_568
    assert len(use.plugin.kv_cache_spec(None, SimpleNamespace(tensor_parallel_size=1))) == 4
    assert use.report["decision"] == "engine (no plugin)"
    verify_proposals(use, [{"gpu_memory_utilization": 0.9, "max_model_len": 4096, "num_gpu_blocks": 10}],
                     lambda u, m: 10 * 32 * 65536)
    assert use.report["proposals"][0]["agree"] is True
    assert use.session.sized == [(10 * 32 * 65536, 4096)]


def test_unserved_architecture_engine_build_failure_is_an_error():
    class Broken(_Session):
        def kv_cache_specs(self):
            raise EngineError("cannot build", where="/m")

    with pytest.raises(EngineError):
        _use(Broken("0.32.0", {}), unserved=True)
    # a served architecture goes on with its plugin and says why
    use = _use(Broken("0.32.0", {}), plugin_specs=_full(2))
    assert use.kv_specs is None and any("cross-check skipped" in w for w in use.warnings)


def test_gpu_block_size_rule():
    assert gpu_block_size({"block_size": 32}, _full(1)) == 32
    assert gpu_block_size({}, _full(1, bs=64)) == 64  # an MLA plugin's backend block
    hybrid = {"a": kvcache.MambaSpec(784, ((3, 4),), (2,)), **_full(1, bs=784)}
    assert gpu_block_size({}, hybrid) == 16  # hybrids start at 16; vLLM aligns them
    assert gpu_block_size({}, None) == 16


def test_term_sources():
    s = crosscheck.term_sources(plugin="engine", engine_kv=True, engine_weights=True, approximate_activation=True,
                                calibrated=False, device_from_catalog=True, engine_defaults=False, method="simulate")
    assert s["kv_cache_spec"] == "engine" and s["weights"] == "engine"
    assert s["activation_peak"] == "plugin(generic, approximate)" and s["total_memory"] == "catalog"
    c = crosscheck.term_sources(plugin="generic", engine_kv=False, engine_weights=False, approximate_activation=False,
                                calibrated=True, device_from_catalog=False, engine_defaults=False, method="simulate")
    assert (c["kv_cache_spec"], c["non_torch"], c["total_memory"]) == ("plugin", "calibration", "drop")


def test_term_sources_stored_and_explained(tmp_path, tiny_config, monkeypatch):
    import yaml

    from tuner.jobs.app import profile
    from tuner.reports.explain import explain_stored, render
    from tuner.reports.results import open_for_read
    import sqlalchemy as sa
    from tuner.store.database import profile_runs_table

    monkeypatch.setenv("CTX_TUNER_ENGINE", "off")
    drop = tmp_path / "d.yaml"
    drop.write_text(yaml.safe_dump({"name": "d", "model": str(tiny_config), "device": "H100-80GB",
                                    "engine_version": "0.19.0",
                                    "candidates": {"gpu_memory_utilization": [0.9], "max_model_len": [4096]}}))
    db = tmp_path / "s.sqlite"
    out = profile(str(drop), db_url=str(db))
    assert out.result["term_sources"]["kv_cache_spec"] == "plugin"
    store = open_for_read(str(db))
    try:
        run = store._rows(sa.select(profile_runs_table))[0]
        assert json.loads(run["term_sources"]) == out.result["term_sources"]
        assert run["engine_check"] is None
        doc = explain_stored(store, run["id"])
    finally:
        store.close()
    assert doc["term_sources"]["weights"] == "plugin"
    assert "sources: total_memory catalog, scheduler_defaults catalog, kv_cache_spec plugin" in render(doc)


def test_engine_check_lines_show_the_difference():
    from tuner.reports.explain import engine_check_lines

    use = _use(_Session("0.32.0", _vllm_specs(32)), plugin_specs=_full(32, heads=4))
    verify_proposals(use, [{"gpu_memory_utilization": 0.9, "max_model_len": 8192, "num_gpu_blocks": 5}],
                     lambda u, m: 10 * 32 * 65536)
    text = "\n".join(engine_check_lines(use.report))
    assert "engine: vLLM 0.32.0 (same release as the drop); KV specs: engine (plugin disagrees)" in text
    assert "difference: num_gpu_blocks: plugin 40960, engine 20480" in text
    assert "gmu 0.9 max_model_len 8192: vLLM kv_cache_utils 10 blocks, ctx-tuner 5  <- differ" in text


def test_worker_python_from_env(monkeypatch):
    import sys

    from tuner.seam.worker import worker_python

    monkeypatch.delenv("CTX_TUNER_WORKER_PYTHON", raising=False)
    assert worker_python() == sys.executable
    monkeypatch.setenv("CTX_TUNER_WORKER_PYTHON", "/opt/vllm/bin/python")
    assert worker_python() == "/opt/vllm/bin/python" and worker_python("/x/python") == "/x/python"


def test_profile_worker_python_not_executable_exit_2(tmp_path, capsys):
    from tuner.cli import main

    rc = main(["profile", str(tmp_path / "d.yaml"), "--worker-python", str(tmp_path / "nope" / "python")])
    assert rc == 2 and "--worker-python" in capsys.readouterr().err


def test_engine_refusal_of_a_drop_setting_is_a_drop_error_else_a_warning():
    from tuner.errors import DropError, ModelConfigError

    def refuse(field):
        def opener(*a, **k):
            raise DropError("vLLM 0.32.0 refuses these settings: bad", path="/d.yaml", field=field)
        return opener

    spec = SimpleNamespace(top={}, architectures=["XForCausalLM"])
    plugin = SimpleNamespace(name="generic")
    kw = dict(model_dir="/m", spec=spec, plugin=plugin, era=era_for("0.32.0"), plugin_specs=_full(2),
              plugin_specs_at=lambda v: _full(2), reference_bytes=1 << 30)
    with pytest.raises(DropError):  # the drop sets quantization: its error
        engine_for_job(d={"engine_version": "0.32.0", "quantization": "awq"}, unserved=False,
                       opener=refuse("quantization"), **kw)
    use = engine_for_job(d={"engine_version": "0.32.0"}, unserved=False, opener=refuse("quantization"), **kw)
    assert use.session is None and any("vLLM refuses the model config" in w for w in use.warnings)
    with pytest.raises(ModelConfigError):
        engine_for_job(d={"engine_version": "0.32.0"}, unserved=True, opener=refuse("quantization"), **kw)
    # "model" (no setting named): the checkpoint's config, never the drop's fault
    use = engine_for_job(d={"engine_version": "0.32.0", "model": "/m"}, unserved=False, opener=refuse("model"), **kw)
    assert use.session is None and use.report["error"].startswith("vLLM 0.32.0 refuses")
