"""vLLM 0.34 (the extensible KV cache), releases newer than the modelled ones, and the release a drop
without ``engine_version`` is answered for (issue 29, release half)."""

from __future__ import annotations

import pytest

from tuner.drop import parse_drop
from tuner.eras import era_for
from tuner.job import mamba_cache_mode


def _drop(extra: str = "", *, version: str | None = "0.15.0"):
    text = ("name: t\nmodel: Qwen/Qwen3.6-27B\ndevice: H100-80GB\ncandidates:\n  gpu_memory_utilization: [0.9]\n"
            + (f"engine_version: \"{version}\"\n" if version else "") + extra)
    return parse_drop(text, "t.yaml")


def test_mamba_cache_mode_formats_vllm_version():
    """club3090-294/295/487 crashed validate with TypeError: 'VllmVersion' object is not iterable
    (the warning joined map(str, era.version))."""

    class Plugin:
        mamba_prefix_caching_mode = "align"

    warnings: list[str] = []
    assert mamba_cache_mode(_drop("enable_prefix_caching: true\n"), era_for("0.15.0"), Plugin(), warnings) is None
    assert warnings == ["enable_prefix_caching on a hybrid model: mamba_cache_mode 'align' in vLLM 0.15.0 is not "
                        "modelled (state blocks counted as without it)"]
