"""tuner.model.kit, the plugin kit: one module with every name a plugin needs, torch-free at import."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from importlib import import_module
from types import SimpleNamespace

import pytest

from tests.conftest import REPO
from tuner.model import kit
from tuner.model.modelspec import ModelSpec
from tuner.model.plugin import RankSettings, stage_layers


def test_importing_the_kit_imports_no_torch():
    code = ("import sys; from tuner.model.kit import ModelPlugin, RankSettings, FullAttentionSpec, stage_layers, "
            "dtype_bytes_for, decoder_kv_specs; import tuner.model.kit; "
            "bad = [m for m in ('torch', 'transformers') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_every_kit_name_is_the_object_of_its_home_module():
    homes = {"ModelPlugin": "tuner.model.plugin", "stage_layers": "tuner.model.plugin", "ModelSpec": "tuner.model.modelspec",
             "FullAttentionSpec": "tuner.memory.kvcache", "mla_spec": "tuner.memory.kvcache", **kit._LAZY}
    for name, module in homes.items():
        assert getattr(kit, name) is getattr(import_module(module), name), name
    assert all(hasattr(kit, n) for n in kit.__all__) and set(kit.__all__) <= set(dir(kit))
    with pytest.raises(AttributeError):
        kit.no_such_name  # noqa: B018


def test_decoder_builder_moved_out_of_moe_keeps_its_old_import():
    from tuner.model.simulate import decoder, moe

    assert moe.build_decoder is decoder.build_decoder is kit.build_decoder
    assert moe.torch_dtype is decoder.torch_dtype is kit.torch_dtype


def test_stage_layers_follows_vllm_pp_split():
    spec = SimpleNamespace(num_hidden_layers=10)
    ranges = [stage_layers(spec, RankSettings(engine_version="0.19.0", dtype="bfloat16", pipeline_parallel_size=4,
                                              pp_rank=r)) for r in range(4)]
    # get_pp_indices: 10 // 4 = 2 each, the remainder 2 to stages -2 and -3 (never the last)
    assert ranges == [range(0, 2), range(2, 5), range(5, 8), range(8, 10)]
    one = RankSettings(engine_version="0.19.0", dtype="bfloat16", pipeline_parallel_size=2, pp_rank=1)
    assert stage_layers(spec, one, num_layers=7) == range(4, 7)  # hybrid_override_pattern length wins


def test_every_modelspec_attribute_is_documented():
    doc = ModelSpec.__doc__
    documented = set(re.findall(r"^        (\w+):", doc.split("Attributes:")[1], flags=re.M))
    assert documented == {f.name for f in dataclasses.fields(ModelSpec)}
