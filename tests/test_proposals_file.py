"""The daemon's proposal file prints a ``vllm serve`` command that works from any directory."""

from __future__ import annotations

from tuner.proposals import _serve_model


def test_local_model_path_is_resolved_against_the_drop_file(tmp_path):
    model = tmp_path / "models" / "m"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    drops = tmp_path / "conf.d"
    drops.mkdir()
    drop = {"model": "../models/m", "path": str(drops / "a.yaml")}
    assert _serve_model(drop) == str(model.resolve())
    assert _serve_model({"model": "../models/m/config.json", "path": str(drops / "a.yaml")}) == str(model.resolve())


def test_hf_ids_are_kept():
    assert _serve_model({"model": "meta-llama/Llama-3.1-8B-Instruct", "path": "/nonexistent/a.yaml"}) == \
        "meta-llama/Llama-3.1-8B-Instruct"
