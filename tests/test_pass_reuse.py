"""Passes on meta tensors with the module built once per job: the same figures as a fresh
``FakeTensorMode`` build for every pass (the behaviour before), on the V0 example, on every
visible case, and on plugins whose modules keep state, read the batch or need fake tensors."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

import tuner.model.simulate.profile as profile  # noqa: E402
from tuner.memory.eras import ProfileBatch, era_for  # noqa: E402
from tuner.model.modelspec import load_model_spec  # noqa: E402
from tuner.model.plugin import ModelPlugin, RankSettings  # noqa: E402
from tuner.model.simulate.profile import FAKE, META, ModelCache, module_state, run_pass  # noqa: E402
from tuner.model.simulate.tracker import _tensors  # noqa: E402
from tests._daemon_helpers import without_elapsed  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

#: The passes as they ran before: a fresh FakeTensorMode build for every pass.
BEFORE = functools.partial(ModelCache, enabled=False, meta=False)


class _Recording(ModelCache):
    """A ModelCache that remembers its instances (to read builds/reuses after a job)."""

    made: list = []

    def __init__(self, **kw):
        super().__init__(**kw)
        _Recording.made.append(self)


def _run_job(request, monkeypatch, cache_factory):
    from tuner.jobs.job import run_job

    monkeypatch.setattr(profile, "ModelCache", cache_factory)
    try:
        return run_job(request)
    finally:
        monkeypatch.setattr(profile, "ModelCache", ModelCache)


def _example_request(name):
    from tuner.jobs.app import prepare_request
    from tuner.question.drop import load_drop

    return prepare_request(load_drop(REPO / "configs" / "examples" / name))[0]


def test_v0_example_passes_identical_with_one_build(monkeypatch):
    """llama-3.1-8b-rtx3090-v0: V0 0.6.4 without chunked prefill, one pass per length probed."""
    request = _example_request("llama-3.1-8b-rtx3090-v0.yaml")
    before = _run_job(request, monkeypatch, BEFORE)
    _Recording.made = []
    after = _run_job(request, monkeypatch, _Recording)
    assert without_elapsed(after) == without_elapsed(before)
    # 15 lengths for the expected value's proposal, 4 more for the interval's safe end (risk safe)
    assert len(after["runs"]) == 21
    assert len({r["max_num_batched_tokens"] for r in after["runs"]}) == 21  # one N per pass
    (cache,) = _Recording.made
    assert (cache.builds, cache.reuses) == (1, 20)
    assert [p["max_model_len_expected"] for p in after["proposals"]] == [40064]
    assert [p["max_model_len"] for p in after["proposals"]] == [37968]  # at the safe end


@pytest.mark.slow
def test_visible_cases_pass_figures_identical_before_and_after(observed_cases, shared_dir, monkeypatch):
    """Every visible case that `ctx-tuner validate` runs: the whole job result (passes,
    candidates, proposals, bytes) equal to the fresh-FakeTensorMode passes."""
    from tuner.errors import TunerError
    from tuner.accuracy.validate import case_request

    compared = 0
    for case in observed_cases.values():
        try:
            request = case_request(case, shared_dir / "models")
        except TunerError:
            continue
        try:
            before = _run_job(request, monkeypatch, BEFORE)
        except TunerError as exc:
            with pytest.raises(type(exc)):
                _run_job(request, monkeypatch, ModelCache)
            continue
        after = _run_job(request, monkeypatch, ModelCache)
        assert without_elapsed(after) == without_elapsed(before), case["id"]
        compared += 1
    assert compared >= 40


# -- toy plugins: what reuse must not change ---------------------------------------------------
class _Toy(nn.Module):
    """``[N, H]`` out of the forward; ``compute_logits`` a real matmul. ``keep`` builds a table
    on the first forward and keeps it (like MoonViT's rotary table); ``buffer_tokens`` sizes a
    buffer by the batch; ``cpu_only`` refuses anything but CPU-device tensors (fake ones say cpu,
    meta ones say meta)."""

    def __init__(self, hidden, vocab, *, keep=False, buffer_tokens=None, cpu_only=False):
        super().__init__()
        self.hidden, self.keep, self.cpu_only = hidden, keep, cpu_only
        self.lm = nn.Parameter(torch.empty(vocab, hidden), requires_grad=False)
        if buffer_tokens:
            self.register_buffer("scratch", torch.empty(buffer_tokens, hidden))
        self.table = None

    def forward(self, input_ids, positions, intermediate=None):
        if self.cpu_only and input_ids.device.type != "cpu":
            raise RuntimeError(f"needs cpu tensors, got {input_ids.device}")
        if self.keep and self.table is None:
            self.table = torch.empty(4096, dtype=torch.float32)
        return torch.empty(input_ids.shape[0], self.hidden)

    def compute_logits(self, hidden):
        return hidden @ self.lm.t()


class _ToyPlugin(ModelPlugin):
    name = "toy"
    architectures = ("ToyForCausalLM",)

    def __init__(self, **kw):
        self.kw = kw

    def kv_cache_spec(self, spec, settings):
        return {}

    def build_model(self, spec, settings):
        kw = dict(self.kw)
        if kw.pop("batch_sized", False):
            kw["buffer_tokens"] = settings.max_num_batched_tokens
        return _Toy(spec.hidden_size, spec.vocab_size, **kw)


def _toy_passes(tiny_config, plugin, cache, ns=(512, 1024, 512)):
    spec = load_model_spec(tiny_config / "config.json")[0]
    era = era_for("0.6.4")
    out = []
    for n in ns:
        st = RankSettings("0.6.4", "float32", compiled=False, runs_attention=True, max_num_batched_tokens=n,
                          max_num_seqs=16)
        r = run_pass(plugin, spec, st, era, ProfileBatch(n, 16, 16, False), models=cache)
        out.append({k: v for k, v in r.to_dict().items() if k != "elapsed_s"})
    return out


@pytest.mark.parametrize("kw,builds", [({}, 1), ({"keep": True}, 3), ({"batch_sized": True}, 2)],
                         ids=["stateless", "keeps-a-table", "reads-the-batch"])
def test_reuse_gives_fresh_build_figures(tiny_config, kw, builds):
    """A stateless module is built once; one that keeps a table from its forward is rebuilt for
    every pass (the table is counted each time, as with fresh modules); one whose build reads
    ``max_num_batched_tokens`` is rebuilt for each new batch (the third pass repeats the first's
    N and reuses its module)."""
    fresh = _toy_passes(tiny_config, _ToyPlugin(**kw), BEFORE())
    cache = ModelCache()
    reused = _toy_passes(tiny_config, _ToyPlugin(**kw), cache)
    assert reused == fresh
    assert cache.builds == builds and cache.builds + cache.reuses == 3
    if kw.get("keep"):  # the 4096 fp32 table is in every pass's forward peak
        assert all(r["forward_peak_bytes"] == 512 * 64 * 4 + 16384 for r in reused if r["max_num_batched_tokens"] == 512)
    if kw.get("batch_sized"):
        assert [r["weights_bytes"] for r in reused] == [(1000 + n) * 64 * 4 for n in (512, 1024, 512)]


def test_pass_failing_on_meta_runs_under_fake_tensor_mode(tiny_config):
    """A module that needs fake-tensor semantics (here: CPU-device tensors) fails on meta tensors;
    the pass then runs under FakeTensorMode, with the figures of the FakeTensorMode pass."""
    fake_only = _toy_passes(tiny_config, _ToyPlugin(cpu_only=True), BEFORE())
    plugin = _ToyPlugin(cpu_only=True)
    cache = ModelCache()
    got = _toy_passes(tiny_config, plugin, cache)
    assert got == fake_only
    assert got[0]["forward_peak_bytes"] == 512 * 64 * 4
    spec = load_model_spec(tiny_config / "config.json")[0]
    assert cache.builds == 2 and cache.reuses == 2  # one meta build (failed), one fake build reused twice
    assert not any(k[2] == META for k in cache._free) and any(k[2] == FAKE for k in cache._free)
    del spec


def test_meta_pass_equals_fake_pass_on_a_real_llama(tiny_config):
    """The generic plugin's tiny Llama: meta and FakeTensorMode passes agree to the byte."""
    from tuner.model.plugin import load_registry

    spec = load_model_spec(tiny_config / "config.json")[0]
    plugin = load_registry().by_name("generic")
    for version in ("0.6.4", "0.19.0"):
        era = era_for(version)
        st = RankSettings(version, "bfloat16", compiled=era.compiled, runs_attention=era.engine == "V0",
                          tensor_parallel_size=2)
        batch = ProfileBatch(2048, 64, 64, True)
        meta = run_pass(plugin, spec, st, era, batch, models=ModelCache())
        fake = run_pass(plugin, spec, st, era, batch, models=BEFORE())
        assert {**meta.to_dict(), "elapsed_s": 0} == {**fake.to_dict(), "elapsed_s": 0}
        assert meta.activation_peak_bytes > 0


def test_module_state_sees_a_kept_tensor_and_a_grown_list():
    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    m[0].notes = []
    before = module_state(m)
    assert module_state(m) == before
    m[1].cache = torch.empty(3)
    assert module_state(m) != before
    del m[1].cache
    assert module_state(m) == before
    m[0].notes.append(torch.empty(1))
    assert module_state(m) != before


def _reference_ident(value, depth=0):
    """:func:`tuner.model.simulate.profile._ident` as it was before its fast paths (the reference)."""
    t = type(value)
    if t in profile._SCALARS:
        return value
    if depth > 2 or isinstance(value, (torch.Tensor, torch.nn.Module, type)):
        return id(value)
    if t in profile._SEQUENCES:
        return (id(value), tuple([_reference_ident(v, depth + 1) for v in value])) if value else (id(value), 0)
    if isinstance(value, dict):
        return (id(value), tuple([(k, _reference_ident(v, depth + 1)) for k, v in value.items()])) if value else id(value)
    if isinstance(value, (set, frozenset)):
        return (id(value), frozenset(map(id, value)))
    if hasattr(value, "__dict__") and not callable(value):
        return (id(value), tuple([(k, _reference_ident(v, depth + 1)) for k, v in vars(value).items()]))
    return id(value)


def _reference_state(model):
    return tuple((name, _reference_ident(vars(m))) for name, m in model.named_modules(remove_duplicate=False))


def test_module_state_equals_the_reference_fingerprint(tiny_config):
    """The fast paths of ``_ident`` give the very tuple of the plain recursion: on the generic
    plugin's module (TP 2, V0 and V1) and on a module with nested containers, objects, sets and
    an OrderedDict subclass."""
    import collections

    from tuner.model.plugin import load_registry

    spec = load_model_spec(tiny_config / "config.json")[0]
    plugin = load_registry().by_name("generic")
    for version in ("0.6.4", "0.19.0"):
        era = era_for(version)
        st = RankSettings(version, "bfloat16", compiled=era.compiled, runs_attention=era.engine == "V0",
                          tensor_parallel_size=2)
        cache = ModelCache()
        run_pass(plugin, spec, st, era, ProfileBatch(2048, 64, 64, True), models=cache)
        (built,) = cache._free.values()
        assert module_state(built.model) == _reference_state(built.model) == built.state

    class _Od(collections.OrderedDict):
        pass

    class _Plain:
        def __init__(self):
            self.a, self.b = [1, (2.0, None)], {"k": [torch.empty(1)]}

    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    m[0].notes = [[], (), [3, "x", [4, [5, [6]]]], {"d": {"e": {"f": {"g": 1}}}}, _Plain(), {1, 2}, frozenset()]
    m[1].table = _Od(a=1, b=[torch.float16, nn.Linear], c=_Od())
    m[1].maps = collections.OrderedDict(x=None, y={"z": (1, [2])})
    assert module_state(m) == _reference_state(m)


def test_one_pass_job_fingerprints_its_module_once(monkeypatch):
    """The 70B TP4 example runs one pass: its module is fingerprinted after the build only (the
    check that a pass left it as built runs when a later pass takes it, and none does)."""
    calls = []
    real = profile.module_state
    monkeypatch.setattr(profile, "module_state", lambda model: calls.append(1) or real(model))
    from tuner.jobs.job import run_job

    result = run_job(_example_request("llama-3.1-70b-h100-tp4.yaml"))
    assert len(result["runs"]) == 1 and len(calls) == 1


def test_tracker_flattening_matches_tree_flatten():
    from torch.utils._pytree import tree_flatten

    a, b, c = torch.empty(1), torch.empty(2), torch.empty(3)
    tree = ((a, [b, 3, None, torch.float16], {"x": c, "y": (a,)}), {"k": [b]}, torch.Size([2, 3]),
            torch.return_types.sort((a, b)))
    expected = [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]
    assert [id(t) for t in _tensors(tree)] == [id(t) for t in expected]
    assert _tensors(5) == [] and _tensors(a) == [a]


def test_dense_pass_never_imports_dynamo(tmp_path):
    """The 70B TP4 example's job in a fresh worker: no ``torch._dynamo`` (seconds of a cold
    start): the tracker opts out of TorchDispatchMode's dynamo wrapper and the passes use no
    Python-reference op."""
    import subprocess
    import sys

    request = _example_request("llama-3.1-70b-h100-tp4.yaml")
    (tmp_path / "req.json").write_text(json.dumps(request))
    code = ("import json, sys\nfrom tuner.jobs.job import run_job\n"
            f"r = run_job(json.load(open({str(tmp_path / 'req.json')!r})))\n"
            "print(json.dumps({'dynamo': 'torch._dynamo' in sys.modules, 'runs': len(r['runs']), "
            "'proposals': [p['max_model_len_expected'] for p in r['proposals']]}))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"dynamo": False, "runs": 1, "proposals": [112256, 125232]}  # [111840, 124816] before §24
