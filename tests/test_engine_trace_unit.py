"""``engine-trace`` pieces that need no vLLM: the margin of kernel-dependent parts, the part an
op belongs to, the term sources of a traced run, and the fallback when a trace cannot run."""

from __future__ import annotations

from types import SimpleNamespace

from tuner.engine import crosscheck
from tuner.engine.fakes import kernel_part
from tuner.engine.trace import (MARGIN_PER_PART, EngineTraceUnavailable, SAMPLER_PART,
                                approximate_margin_bytes)
from tuner.engine.use import EnginePlugin, EngineUse
from tuner.memory.eras import ProfileBatch, era_for


def test_kernel_parts_of_vllm_ops():
    assert kernel_part("_C::cpu_fused_moe") == "fused MoE"
    assert kernel_part("_C::cpu_gemm_wna16") == "quantized GEMM"
    assert kernel_part("_C::mamba_chunk_scan_fwd_cpu") == "SSM / linear-attention kernel"
    assert kernel_part("_C::chunk_gated_delta_rule_cpu") == "SSM / linear-attention kernel"
    assert kernel_part("_C::concat_and_cache_mla_cpu") == "MLA prefill"
    assert kernel_part("_C::rms_norm") is None and kernel_part("vllm::unified_attention_with_output") is None


def test_margin_counts_kernel_parts_but_not_the_sampler():
    fwd = 1_000_000_000
    assert approximate_margin_bytes(fwd, [SAMPLER_PART]) == 0
    assert approximate_margin_bytes(fwd, ["fused MoE", SAMPLER_PART]) == int(fwd * MARGIN_PER_PART)
    assert approximate_margin_bytes(fwd, ["fused MoE", "quantized GEMM"]) == 2 * int(fwd * MARGIN_PER_PART)
    assert approximate_margin_bytes(fwd, ["Model Runner V2 sampler (the V1 runner's traced)"]) == 0
    # a known Triton MoE workspace replaces the fraction for the fused MoE, not for the others
    assert approximate_margin_bytes(fwd, ["fused MoE", SAMPLER_PART], moe_workspace_bytes=335_544_320) == 335_544_320
    assert approximate_margin_bytes(fwd, ["fused MoE", "MLA prefill"], moe_workspace_bytes=5) == 5 + int(
        fwd * MARGIN_PER_PART)


def test_term_sources_of_a_traced_run():
    kw = dict(plugin="engine", engine_kv=True, engine_weights=True, calibrated=False, device_from_catalog=True,
              engine_defaults=False, method="simulate")
    s = crosscheck.term_sources(approximate_activation=False, traced_activation=True,
                                approximate_parts=["fused MoE", SAMPLER_PART], **kw)
    assert s["activation_peak"] == "engine-trace"
    assert s["activation_approximate"] == "fused MoE, top-k/top-p sampler"
    fallback = crosscheck.term_sources(approximate_activation=True, traced_activation=False, **kw)
    assert fallback["activation_peak"] == "plugin(generic, approximate)" and "activation_approximate" not in fallback


def _use(monkeypatch, trace):
    import tuner.engine.trace as tr_mod

    monkeypatch.setattr(tr_mod, "trace_profile_run", trace)
    generic = SimpleNamespace(name="generic", config_defaults=lambda top: {})
    use = EngineUse(plugin=EnginePlugin(generic, {}, 7_000_000, 1, ("X",)), session=SimpleNamespace(version="0.32.0"),
                    trace_activation=True)
    return use


def _pass_args():
    spec = SimpleNamespace(hidden_size=64, vocab_size=512)
    settings = SimpleNamespace(max_num_seqs=16, max_model_len=2048, dtype="bfloat16", block_size=16, pp_rank=0,
                               tensor_parallel_size=1)
    return spec, settings, era_for("0.32.0"), ProfileBatch(2048, 16, 16, True)


def test_traced_pass_adds_margin_and_persistent_buffers(monkeypatch):
    fwd = 3_000_000
    use = _use(monkeypatch, lambda s, **kw: {
        "max_num_batched_tokens": kw["max_num_batched_tokens"], "num_reqs": kw["max_num_seqs"],
        "forward_peak_bytes": fwd, "sampler_peak_bytes": 500_000, "activation_peak_bytes": fwd + 100_000,
        "ops": ["_C::cpu_fused_moe"], "approximate": ["fused MoE", SAMPLER_PART], "fake_kernels": 36, "notes": [],
        "timings": {}})
    spec, settings, era, batch = _pass_args()
    r = use.run_pass(None, spec, settings, era, batch, model_runner_v2=False)
    (t,) = use.report["trace"]
    assert use.traced and not use.approximate_activation
    assert r.weights_bytes == 7_000_000 and r.forward_peak_bytes == fwd
    assert t["margin_bytes"] == int(fwd * MARGIN_PER_PART) and t["persistent_bytes"] == r.persistent_bytes > 0
    assert r.activation_peak_bytes == fwd + 100_000 + t["margin_bytes"] + t["persistent_bytes"]
    assert use.approximate_parts() == ["fused MoE", SAMPLER_PART]


def test_trace_that_cannot_run_falls_back_to_the_plugin_with_a_warning(monkeypatch):
    import tuner.model.simulate.profile as profile

    def broken(s, **kw):
        raise EngineTraceUnavailable("op _C::foo has no fake kernel", where="/m")

    use = _use(monkeypatch, broken)
    seen = []
    monkeypatch.setattr(profile, "run_pass", lambda *a, **k: seen.append(a) or "plugin pass")
    spec, settings, era, batch = _pass_args()
    assert use.run_pass("plugin", spec, settings, era, batch, model_runner_v2=False) == "plugin pass"
    assert use.approximate_activation and not use.trace_activation and not use.traced and len(seen) == 1
    assert any("engine-trace not run" in w and "_C::foo" in w for w in use.warnings)
    assert "_C::foo" in use.report["trace"][0]["error"]
    # later passes go straight to the plugin
    use.run_pass("plugin", spec, settings, era, batch, model_runner_v2=False)
    assert len(seen) == 2 and len(use.warnings) == 1


def test_explain_shows_the_trace_and_a_trace_that_did_not_run():
    from tuner.reports.explain import engine_check_lines

    rep = {"release": "0.32.0", "releases_match": True, "decision": "engine (no plugin)",
           "trace": [{"release": "0.32.0", "max_num_batched_tokens": 8192, "num_reqs": 256,
                      "forward_peak_bytes": 973185024, "sampler_peak_bytes": 790113280,
                      "activation_peak_bytes": 973185024, "margin_bytes": 0, "persistent_bytes": 67944448,
                      "approximate": [SAMPLER_PART]},
                     {"error": "op _C::foo has no fake kernel"}]}
    text = "\n".join(engine_check_lines(rep))
    assert "engine-trace (vLLM 0.32.0 _dummy_run + _dummy_sampler_run, N 8192, R 256): forward peak 973185024 B" in text
    assert "approximate: top-k/top-p sampler" in text and "engine-trace not run: op _C::foo" in text


class _DefaultsSession:
    version = "0.32.0"

    def __init__(self, n: int, s: int) -> None:
        self.n, self.s, self.asked = n, s, []

    def batch_defaults(self, *, device_name, total_memory_bytes, entry_point):
        self.asked.append((device_name, total_memory_bytes, entry_point))
        return {"max_num_batched_tokens": self.n, "max_num_seqs": self.s, "enable_chunked_prefill": True,
                "block_size": 16, "source": "test"}


def test_engine_defaults_recorded_and_applied_only_when_the_releases_match():
    from tuner.engine.use import reconcile_defaults

    era_batch = ProfileBatch(8192, 1024, 1024, True)
    dev = {"name": "H100-80GB", "total_memory_bytes": 80 << 30}
    # same values: recorded, nothing to apply
    use = EngineUse(session=_DefaultsSession(8192, 1024), report={"releases_match": True})
    assert reconcile_defaults(use, era_batch=era_batch, block_size=16, d={"entry_point": "serve"}, device=dev) == {}
    assert use.report["defaults"]["engine"]["max_num_batched_tokens"] == 8192
    assert use.report["defaults"]["differences"] == [] and use.session.asked == [("H100-80GB", 80 << 30, "serve")]
    # the engine differs, same release: its value is used, and the difference is printed
    use = EngineUse(session=_DefaultsSession(16384, 1024), report={"releases_match": True})
    got = reconcile_defaults(use, era_batch=era_batch, block_size=16, d={}, device=dev)
    assert got == {"max_num_batched_tokens": 16384}
    assert use.report["defaults"]["differences"] == ["max_num_batched_tokens: engine 16384, era rule 8192"]
    assert any("the engine's is used" in w for w in use.warnings)
    # another release: printed, the era rule stays
    use = EngineUse(session=_DefaultsSession(16384, 1024), report={"releases_match": False})
    assert reconcile_defaults(use, era_batch=era_batch, block_size=16, d={"engine_version": "0.19.0"}, device=dev) == {}
    assert use.report["defaults"]["differences"] and "era rules for 0.19.0" in use.report["defaults"]["rule"]
    assert any("the era rule's is used" in w for w in use.warnings)
    # a key the drop sets is never compared nor replaced
    use = EngineUse(session=_DefaultsSession(16384, 1024), report={"releases_match": True})
    assert reconcile_defaults(use, era_batch=era_batch, block_size=16, d={"max_num_batched_tokens": 8192},
                              device=dev) == {}
    assert use.report["defaults"]["differences"] == []


def test_explain_shows_engine_defaults_next_to_the_era_rules():
    from tuner.reports.explain import engine_check_lines

    rep = {"release": "0.32.0", "releases_match": True, "decision": "plugin (engine agrees)",
           "defaults": {"engine": {"max_num_batched_tokens": 16384, "max_num_seqs": 1024, "enable_chunked_prefill": True,
                                   "block_size": 16},
                        "ctx_tuner": {"max_num_batched_tokens": 8192, "max_num_seqs": 1024,
                                      "enable_chunked_prefill": True, "block_size": 16},
                        "differences": ["max_num_batched_tokens: engine 16384, era rule 8192"],
                        "applied": {"max_num_batched_tokens": 16384}, "rule": "the engine's (same release as the drop)"}}
    text = "\n".join(engine_check_lines(rep))
    assert "scheduler defaults (engine / era rule): max_num_batched_tokens 16384 / 8192, max_num_seqs 1024 / 1024" in text
    assert "default differs: max_num_batched_tokens: engine 16384, era rule 8192 (engine's applied)" in text


# -- issue 34: the engine trace isolated -------------------------------------------------------------

def test_trace_killed_by_sigsegv_failed_the_job(monkeypatch):
    """The traced profile run died with SIGSEGV inside a compiled kernel fed a fake tensor's data
    pointer (Qwen3-Next), and took the worker and its job with it (``WorkerError … killed by
    signal 11``, exit 1). The trace runs in a sacrificial child now: this process lives on, and
    the pass falls back to the plugin's with the crash named in the warning and the report."""
    import os
    import signal

    import tuner.model.simulate.profile as profile

    def segfault(s, **kw):
        os.kill(os.getpid(), signal.SIGSEGV)

    use = _use(monkeypatch, segfault)
    monkeypatch.setattr(profile, "run_pass", lambda *a, **k: "plugin pass")
    spec, settings, era, batch = _pass_args()
    assert use.run_pass("plugin", spec, settings, era, batch, model_runner_v2=False) == "plugin pass"
    assert use.approximate_activation and not use.traced
    (w,) = use.warnings
    assert w.startswith("engine-trace not run (engine-trace: the traced profile run crashed: its process was killed by "
                        "signal 11 (SIGSEGV); the crash stayed in that sacrificial process)")
    assert use.report["trace"] == [{"error": w[len("engine-trace not run ("):w.index("); activation peak")],
                                    "crash": "SIGSEGV"}]


def test_isolated_trace_returns_results_and_typed_errors_and_names_aborts():
    import os

    from tuner.engine.isolate import EngineTraceCrashed, run_isolated

    assert run_isolated(lambda a, b=0: {"sum": a + b, "pid": os.getpid()}, 2, b=3)["sum"] == 5
    assert run_isolated(lambda: os.getpid()) != os.getpid()  # it ran elsewhere

    def typed():
        raise EngineTraceUnavailable("op _C::foo has no fake kernel", where="/m")

    try:
        run_isolated(typed)
    except EngineTraceUnavailable as exc:
        assert type(exc) is EngineTraceUnavailable and (exc.message, exc.where) == ("op _C::foo has no fake kernel", "/m")
    else:  # pragma: no cover
        raise AssertionError("no error")
    for fn, needle in ((os.abort, "killed by signal 6 (SIGABRT)"), (lambda: os._exit(3), "exit status 3")):
        try:
            run_isolated(fn, where="m")
        except EngineTraceCrashed as exc:
            assert needle in exc.message and exc.where == "m"
        else:  # pragma: no cover
            raise AssertionError("no crash")

    def untyped():
        raise RuntimeError("Accessing the data pointer of FakeTensor is deprecated")

    try:
        run_isolated(untyped)
    except EngineTraceUnavailable as exc:
        assert exc.message == "RuntimeError: Accessing the data pointer of FakeTensor is deprecated"
