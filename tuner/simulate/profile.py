"""One simulated (or real-CPU) profile pass: build the rank's module, run vLLM's dummy batch,
track live bytes, return the peaks. Worker side (imports torch)."""

from __future__ import annotations

import contextlib
import time
from dataclasses import asdict, dataclass

import torch

from tuner.budget import runner_persistent_bytes
from tuner.eras import Era, ProfileBatch, sampler_family
from tuner.plugin import RankSettings
from tuner.simulate.sampler import run_dummy_sampler
from tuner.simulate.tracker import MemoryTracker


@dataclass(frozen=True)
class PassResult:
    """Peaks of one profile pass on one rank (bytes, ints; ``elapsed_s`` in seconds).

    ``activation_peak_bytes`` is vLLM's torch peak increase: the highest live bytes allocated
    during the forward and the dummy sampler run, above what existed before the pass.
    """

    max_num_batched_tokens: int
    num_reqs: int
    pp_rank: int
    weights_bytes: int
    activation_peak_bytes: int
    forward_peak_bytes: int
    sampler_peak_bytes: int
    elapsed_s: float
    #: Model-runner buffers allocated after the start-up snapshot that V1 0.27+ charges through
    #: ``total_consumed`` (:func:`tuner.budget.runner_persistent_bytes`); included in
    #: ``activation_peak_bytes``. 0 in earlier eras.
    persistent_bytes: int = 0
    #: The pass ran Model Runner V2's profile (:func:`tuner.eras.uses_model_runner_v2`).
    model_runner_v2: bool = False

    def to_dict(self) -> dict:
        return asdict(self)


def run_pass(plugin, spec, settings: RankSettings, era: Era, batch: ProfileBatch, *, fake: bool = True,
             num_sms: int = 132, model_runner_v2: bool = False) -> PassResult:
    """Run one profile pass of ``plugin``'s module for ``spec`` on one rank.

    Args:
        fake: build and run under ``FakeTensorMode`` (no real memory); ``False`` runs real CPU
            tensors (small models only; used to check the fake pass).
        num_sms: the GPU's streaming multiprocessors (sizes the Triton sampler scratch).
        model_runner_v2: the release profiles with Model Runner V2 (its sampler and buffers).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    t0 = time.perf_counter()
    n, r = batch.max_num_batched_tokens, batch.num_reqs
    mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext()
    with torch.no_grad(), mode:
        from tuner.simulate.moe import expert_layout

        with expert_layout(settings.tensor_parallel_size, getattr(settings, "data_parallel_size", 1),
                           getattr(settings, "enable_expert_parallel", False)):
            model = plugin.build_model(spec, settings)
        weights = int(plugin.weights_bytes(spec, settings, model))
        input_ids = torch.zeros(n, dtype=torch.long)
        positions = torch.zeros(n, dtype=torch.long)
        first = settings.pp_rank == 0
        last = settings.pp_rank == settings.pipeline_parallel_size - 1
        intermediate = None
        with MemoryTracker() as tracker:
            if not first:
                # Non-first stages receive N-token hidden states and residuals; the runner makes
                # this buffer on its first dummy run, i.e. inside the profile
                # (vllm/v1/worker/gpu_model_runner.py _dummy_run, make_empty_intermediate_tensors).
                p = next(model.parameters())
                intermediate = (torch.empty(n, spec.hidden_size, dtype=p.dtype),
                                torch.empty(n, spec.hidden_size, dtype=p.dtype))
            out = model(input_ids, positions, intermediate)
            forward_peak = tracker.peak_bytes
            before_sampler = tracker.live_bytes
            tracker.reset_peak()
            if last:
                run_dummy_sampler(sampler_family(era, model_runner_v2=model_runner_v2), model, out, num_reqs=r,
                                  num_sms=num_sms, version=era.version.key)
            sampler_peak = tracker.peak_bytes - before_sampler
            del out
        peak = max(forward_peak, before_sampler + sampler_peak)
    persistent = runner_persistent_bytes(
        era, model_runner_v2=model_runner_v2, max_num_batched_tokens=n,
        max_num_seqs=settings.max_num_seqs or batch.max_num_seqs,
        max_model_len=settings.max_model_len or n, hidden_size=int(spec.hidden_size),
        vocab_size=int(spec.vocab_size), dtype_bytes=_DTYPE_BYTES.get(settings.dtype, 2),
        block_size=settings.block_size or 16)
    return PassResult(n, r, settings.pp_rank, weights, int(peak) + persistent, int(forward_peak), int(sampler_peak),
                      round(time.perf_counter() - t0, 4), persistent, bool(model_runner_v2))


_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "half": 2, "float": 4}
