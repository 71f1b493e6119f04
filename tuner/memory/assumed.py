"""Assumed inputs whose other value ctx-tuner computes: the alternative's rank settings (pure).

Where a record or drop does not say an input that changes memory and ctx-tuner has a rule for both
of its values, the point prediction takes what ``pip install vllm==X`` gets (issue 28) and says so
(the job's ``assumptions``); the other value is then no unknown: the job runs its profile pass too
(:meth:`tuner.jobs.job.Passes.passes_at`) and the interval widens by exactly its effect on the KV
(:class:`tuner.memory.uncertainty.Alternative`, :func:`tuner.memory.uncertainty.alternative_band`),
one-sided, instead of a fraction of the request.

* ``flashinfer_installed`` (V1 0.8.0 – 0.11.0, :func:`tuner.memory.eras.sampler_path`): FlashInfer is
  no dependency of the wheel before 0.11.1, so the point's dummy sampler sorts with PyTorch (≈ 38 B
  per sampled logit, :func:`tuner.model.simulate.sampler.sort_workspace`); installed, the same
  ``TopKTopPSampler.__init__`` (vllm/v1/sample/ops/topk_topp_sampler.py) picks FlashInfer's
  top-k/top-p (two fp32 ``[R, V]`` buffers beside the fp32 logits, ≈ 14 B) unless
  ``VLLM_USE_FLASHINFER_SAMPLER=0``;
* ``triton_kernels_installed`` (MXFP4 on a CUDA Hopper card, 0.10.1 – 0.11.2,
  :func:`tuner.memory.quant.mxfp4_hopper_triton`): without the package the experts run Marlin
  (hidden padded to 256, intermediate to 128); with it, the Triton layout
  (vllm/model_executor/layers/quantization/mxfp4.py ``get_mxfp4_backend``).

What has no rule for its other value (a cold compile cache, a ROCm card's libraries, unified
memory's host growth, a release not stated, an unknown card's compute capability) stays on the
not-modelled fraction (:data:`tuner.memory.uncertainty.NOT_MODELLED`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping


@dataclass(frozen=True)
class AlternativeSettings:
    """An assumption's other value as the rank settings a profile pass takes: ``name`` and ``value``
    as the assumption says them, ``alternative`` the other value, ``settings`` the
    :class:`tuner.model.plugin.RankSettings` fields it changes, ``source`` the release and file
    whose rule gives the other path."""

    name: str
    value: Any
    alternative: Any
    settings: tuple
    source: str

    def apply(self, stage: Any) -> Any:
        """``stage`` (a :class:`tuner.model.plugin.RankSettings`) with the alternative's fields."""
        import dataclasses

        return dataclasses.replace(stage, **dict(self.settings))

    def changes(self, stage: Any) -> bool:
        """Whether the alternative changes anything on ``stage`` (else its effect is 0 without a pass)."""
        return any(getattr(stage, k) != v for k, v in self.settings)


def alternative_settings(assumption: Mapping[str, Any], era: Any, *,
                         use_flashinfer_sampler: Any = None) -> AlternativeSettings | None:
    """The other value of one of the job's assumptions (``{"name", "value", "why"}``, as
    :func:`tuner.memory.eras.sampler_path` and :func:`tuner.memory.quant.mxfp4_hopper_triton` give
    them) as rank settings, or None where ctx-tuner has no rule for it."""
    name = str(assumption.get("name") or "")
    v = era.version
    if name == "flashinfer_installed":
        from tuner.memory.eras import sampler_path

        other = not bool(assumption.get("value"))
        path = sampler_path(era, flashinfer_installed=other, use_flashinfer_sampler=use_flashinfer_sampler)
        return AlternativeSettings(
            name, bool(assumption.get("value")), other, (("flashinfer_sampler", bool(path.flashinfer)),),
            f"vllm/v1/sample/ops/topk_topp_sampler.py {v}: installed, the dummy sampler runs FlashInfer's "
            "top-k/top-p (2 fp32 [R, V] buffers, ~14 B per sampled logit) instead of PyTorch's sort (~38 B)"
            if other else
            f"vllm/v1/sample/ops/topk_topp_sampler.py {v}: not installed, PyTorch's sort (~38 B per sampled logit)")
    if name == "triton_kernels_installed":
        other = not bool(assumption.get("value"))
        return AlternativeSettings(
            name, bool(assumption.get("value")), other, (("triton_kernels_installed", other),),
            f"vllm/model_executor/layers/quantization/mxfp4.py {v}: "
            + ("installed, MXFP4 experts on Hopper take the Triton layout instead of Marlin's" if other else
               "not installed, MXFP4 experts on Hopper run Marlin (hidden padded to 256, intermediate to 128)"))
    return None


__all__ = ["AlternativeSettings", "alternative_settings"]
