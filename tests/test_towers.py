"""Vision towers are modules of their own (tuner/model/simulate/towers/): a family composes a built-in
tower by name or by module, or brings a tower module of its own."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from tuner.model.simulate.towers.base import Geometry, lin


def test_every_builtin_tower_module_is_registered_under_its_kind():
    from tuner.model.simulate import vision
    from tuner.model.simulate.towers import gemma4, llama4, moonvit, pixtral, qwen3_5, siglip

    mods = (pixtral, siglip, llama4, moonvit, qwen3_5, gemma4)
    assert vision.TOWERS == {m.KIND: m for m in mods} and vision.KINDS == tuple(m.KIND for m in mods)
    assert [m.KIND for m in mods if not m.QUANTIZABLE] == ["llama4", "moonvit", "gemma4"]  # vLLM passes no quant_config
    assert [m.KIND for m in mods if not hasattr(m, "encode")] == ["gemma4"]  # weights only
    with pytest.raises(ValueError, match="unknown vision tower kind 'nope'"):
        vision.tower_for("nope")


def test_a_tower_module_composes_like_its_name(shared_dir):
    from tuner.model.simulate import vision
    from tuner.model.simulate.towers import siglip

    top = json.loads((shared_dir / "models" / "google--gemma-3-27b-it" / "config.json").read_text())
    by_name = vision.VisionTower(top, torch.bfloat16, kind="siglip", tp=2)
    by_module = vision.VisionTower(top, torch.bfloat16, kind=siglip, tp=2)
    shapes = lambda t: [(n, tuple(v.shape)) for n, v in list(t.named_parameters()) + list(t.named_buffers())]
    assert by_module.kind == "siglip" and shapes(by_module) == shapes(by_name) != []
    assert vision.vision_tower_bytes(top, 2, kind=siglip, tp=2) == vision.vision_tower_bytes(top, 2, kind="siglip", tp=2)


def test_a_tower_of_ones_own_builds_through_vision_tower():
    from tuner.model.simulate.vision import VisionTower, vision_tower_bytes

    def params(vc, top, g):
        return [("my_tower.patch.weight", (g.hidden, 3 * g.patch * g.patch), "w"),
                lin("my_tower.proj", g.hidden, top["text_config"]["hidden_size"], True, "col"),
                ("my_tower.rotary.inv_freq", (16,), "f32")]

    mine = SimpleNamespace(
        KIND="mine", QUANTIZABLE=False, params=params,
        geometry=lambda vc, top: Geometry("mine", vc["hidden_size"], 0, 1, 1, vc["patch_size"], 0, 3, "mine"))
    top = {"vision_config": {"hidden_size": 64, "patch_size": 4}, "text_config": {"hidden_size": 128}}
    expected = 2 * (64 * 48 + 64 * 64 + 64) + 4 * 16  # patch [64, 48], proj [128/2, 64] + bias, fp32 table
    assert vision_tower_bytes(top, 2, kind=mine, tp=2) == expected
    tower = VisionTower(top, torch.bfloat16, kind=mine, tp=2)
    assert sum(t.numel() * t.element_size() for t in list(tower.parameters()) + list(tower.buffers())) == expected
    assert tower(8192) is None  # no encode: weights only
