"""Lean worker imports, torch side: a meta pass runs without sympy / the real
``symbolic_shapes`` / ``torch._dynamo`` (tuner/model/torch_lean.py, the bias linear in
tuner/model/simulate/layers.py), the stand-in's fast paths equal the real helpers, and the one-shot
worker's preload freezes the imports (tuner/worker_main.preload). Checked through ``sys.modules``
in fresh processes (no timings)."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from tests.conftest import SHARED  # noqa: E402
from tuner.model import torch_lean  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("sympy", "torch._dynamo", "torch._inductor", "torch.distributed.tensor", "transformers.activations")


def _child(code: str, *args: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], cwd=REPO, capture_output=True,
                          text=True, env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


CASE_JOB = """
import json, sys
from tuner.accuracy.validate import case_request, load_cases
from tuner.jobs.job import run_job
from tuner.model import torch_lean
cases = {c["id"]: c for c in load_cases(sys.argv[1])}
out = {}
for cid in sys.argv[3:]:
    result = run_job(case_request(cases[cid], sys.argv[2]))
    out[cid] = [(r["max_num_batched_tokens"], r["activation_peak_bytes"], r["weights_bytes"]) for r in result["runs"]]
out["_modules"] = sorted(m for m in %r if m in sys.modules)
out["_symbolic_shapes_in_sys_modules"] = torch_lean.NAME in sys.modules
out["_state"] = dict(torch_lean.STATE)
print(json.dumps(out))
""" % (HEAVY,)


@pytest.mark.slow
def test_meta_pass_imports_no_sympy_dynamo_or_torch_distributed():
    """Llama-3.1-8B (no bias; V1, and V0 where attention runs) and Qwen2.5-7B (q/k/v bias: the
    linear that went through addmm's decomposition and imported torch._dynamo) run their passes
    with none of the heavy modules imported, and the stand-in has left sys.modules after them."""
    cases = SHARED / "cases" / "vllm-observed.jsonl"
    if not cases.is_file():
        pytest.skip("shared cases not found")
    ids = ["llmd-v019-meta-llama-llama-3-1-8b--tp1pp1dp1--8192", "llmd-v019-qwen-qwen2-5-7b-instruct-tp2pp1dp1--8192",
           "vllm-10517-rtx3090-llama31-8b-29k"]
    out = _child(CASE_JOB, str(cases), str(SHARED / "models"), *ids)
    assert out["_modules"] == []
    assert out["_symbolic_shapes_in_sys_modules"] is False
    assert out["_state"] == {"symbolic_shapes": "deferred"}
    for cid in ids:
        assert out[cid] and all(peak > 0 and weights > 0 for _, peak, weights in out[cid])


def test_stand_in_fast_paths_equal_the_real_helpers():
    """Every helper the stand-in answers itself gives the real function's value for plain values,
    and the real function's error for a wrong type (it is called for anything not plain)."""
    import torch.fx.experimental.symbolic_shapes as real

    stand_in = torch_lean._stand_in()
    values = [True, False]
    for name in ("guard_or_false", "guard_or_true", "statically_known_true", "guard_bool",
                 "expect_true", "guarding_hint_or_throw", "has_guarding_hint"):
        for v in values:
            assert getattr(stand_in, name)(v) == getattr(real, name)(v), name
    for name in ("guard_int", "guarding_hint_or_throw", "has_guarding_hint", "is_nested_int", "_advise_is_size"):
        for v in (0, 7, 1 << 40):
            assert getattr(stand_in, name)(v) == getattr(real, name)(v), name
    assert stand_in.has_guarding_hint(1.5) == real.has_guarding_hint(1.5)
    for a, b in ((3, 3), (3, 4), ((1, 2), (1, 2)), ((1, 2), [1, 2]), ((1, 2), (1, 3)), ((1,), (1, 1)), ((), ())):
        assert stand_in.sym_eq(a, b) == real.sym_eq(a, b) and type(stand_in.sym_eq(a, b)) is type(real.sym_eq(a, b))
    for args in ((True,), (True, False), (False, False, True), (True, True, True)):
        assert stand_in.sym_and(*args) == real.sym_and(*args)
        assert stand_in.sym_or(*args) == real.sym_or(*args)
    for name, bad in (("guard_or_false", 1), ("expect_true", "x"), ("guard_int", 1.0), ("statically_known_true", None)):
        with pytest.raises(AssertionError):
            getattr(real, name)(bad)
        with pytest.raises(AssertionError):
            getattr(stand_in, name)(bad)
    assert stand_in.ShapeEnv is real.ShapeEnv  # any other name: the real module's


def test_stand_in_leaves_an_imported_real_module_alone():
    import torch.fx.experimental.symbolic_shapes as real

    with torch_lean.lean_symbolic_shapes() as active:
        assert active is False
        assert sys.modules[torch_lean.NAME] is real
    assert sys.modules[torch_lean.NAME] is real


FALL_THROUGH = """
import json, sys
import torch
from tuner.model import torch_lean
out = {}
with torch_lean.lean_symbolic_shapes() as active:
    out["active"] = active
    import torch.fx.experimental.symbolic_shapes as ss
    out["stand_in_inside"] = getattr(ss, "_ctx_tuner_stand_in", False)
    out["plain"] = ss.guard_or_false(True)
    out["sympy_after_plain"] = "sympy" in sys.modules
    shape_env = ss.ShapeEnv  # a name the stand-in does not answer: the real module now
    out["sympy_after_other_name"] = "sympy" in sys.modules
    out["real_in_sys_modules"] = not getattr(sys.modules[torch_lean.NAME], "_ctx_tuner_stand_in", False)
import torch.fx.experimental.symbolic_shapes as after
out["after_is_real"] = after.ShapeEnv is shape_env and not getattr(after, "_ctx_tuner_stand_in", False)
out["parent_attr_is_real"] = torch.fx.experimental.symbolic_shapes is after
out["state"] = torch_lean.STATE["symbolic_shapes"]
print(json.dumps(out))
"""


def test_a_name_the_stand_in_lacks_imports_the_real_module_for_good():
    out = _child(FALL_THROUGH)
    assert out == {"active": True, "stand_in_inside": True, "plain": True, "sympy_after_plain": False,
                   "sympy_after_other_name": True, "real_in_sys_modules": True, "after_is_real": True,
                   "parent_attr_is_real": True, "state": "imported"}


PRELOAD = """
import gc, json, sys
from tuner.commands.worker_main import preload
ran = preload(json.loads(sys.argv[1]))
print(json.dumps({"ran": ran, "torch": "torch" in sys.modules, "frozen": gc.get_freeze_count(),
                  "gc_enabled": gc.isenabled(), "heavy": sorted(m for m in %r if m in sys.modules)}))
""" % (HEAVY,)


@pytest.mark.slow
def test_preload_freezes_a_simulate_jobs_imports_and_leaves_other_requests_alone():
    job = _child(PRELOAD, json.dumps({"kind": "job", "method": "simulate"}))
    assert job["ran"] is True and job["torch"] is True and job["gc_enabled"] is True
    assert job["frozen"] > 100_000  # torch's and transformers' objects, never traversed again
    assert job["heavy"] == []  # the lean imports: no sympy, dynamo, torch.distributed.tensor, activations
    validate = _child(PRELOAD, json.dumps({"kind": "validate"}))
    assert validate["ran"] is True and validate["frozen"] > 100_000
    for other in ({"kind": "job", "method": "vllm"}, {"kind": "job", "method": "cuda"}, {"kind": "other"}, [1]):
        out = _child(PRELOAD, json.dumps(other))
        assert out == {"ran": False, "torch": False, "frozen": 0, "gc_enabled": True, "heavy": []}, other


def test_bias_linear_allocates_what_addmm_allocates():
    """The bias linear (mm, then add_ of the bias) counts the same bytes as torch's addmm, on meta
    tensors and on real CPU tensors."""
    from tuner.model.simulate.layers import Linear
    from tuner.model.simulate.tracker import MemoryTracker

    for device in ("meta", "cpu"):
        with torch.device(device), torch.no_grad():
            lin = Linear(64, 96, torch.float32, bias=True)
            x = torch.zeros(10, 64)
            figures = []
            for forward in (lin, lambda t: torch.nn.functional.linear(t, lin.weight, lin.bias)):
                with MemoryTracker() as tracker:
                    out = forward(x)
                    figures.append((tracker.peak_bytes, tracker.live_bytes, tuple(out.shape), out.dtype))
                    del out
        assert figures[0] == figures[1], device
        assert figures[0][0] > 0
    assert gc.isenabled()
