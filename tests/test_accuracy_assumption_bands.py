"""Assumed inputs whose other value ctx-tuner computes widen the interval by exactly that value's effect
(docs/accuracy-mechanisms.md §21, docs/uncertainty.md): ``flashinfer_installed`` (the V1 sampler before
0.11.1) and ``triton_kernels_installed`` (MXFP4 on Hopper before 0.12). The point stays at what ``pip
install vllm==X`` gets; the band is one-sided, the computed alternative's KV less the point's, and the
input keeps no not-modelled fraction (both of its values are computed)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from tuner.memory import uncertainty as unc
from tuner.memory.assumed import alternative_settings
from tuner.memory.eras import era_for

GiB = 1 << 30


def _bands(**kw):
    base = dict(requested_memory_bytes=20 * GiB, weights_bytes=14 * GiB, activation_peak_bytes=2 * GiB,
                reserve_bytes=100 << 20, non_torch_bytes=GiB // 4, cuda_graph_bytes=0,
                sources={"total_memory": "drop", "weights": "plugin", "activation_peak": "plugin",
                         "non_torch": "catalog"})
    base.update(kw)
    return {b.name: b for b in unc.term_bands(**base)}


def _assumed(name: str) -> unc.Unmodelled:
    return unc.Unmodelled(name, "false", name, "widens", "as pip installs it")


# ------------------------------------------------------------------------------------------------
# the band (tuner/memory/uncertainty.py)
# ------------------------------------------------------------------------------------------------

def test_alternative_that_raises_the_kv_widens_the_high_end_by_exactly_its_effect():
    alt = unc.Alternative("flashinfer_installed", False, True, 3 * GiB + 12345, "vllm/v1/sample/ops/x.py 0.11.0")
    bands = _bands(unmodelled=(_assumed("flashinfer_installed"),), alternatives=(alt,))
    b = bands["assumed flashinfer_installed=false"]
    assert unc.band_sides(b.to_dict()) == (0, 3 * GiB + 12345)
    assert b.band_source == unc.ASSUMED_ALTERNATIVE and b.parameter == ""
    assert unc.band_text(b.to_dict()) == "+3.000 GiB (raises the KV only)"
    # both of the input's values are computed: no not-modelled fraction on either side
    assert "not modelled: flashinfer_installed" not in bands
    without = _bands(unmodelled=(_assumed("flashinfer_installed"),))  # no alternative: the 3 % fraction
    kv = 5 * GiB
    lo, hi = unc.kv_interval(kv, bands.values())
    lo0, hi0 = unc.kv_interval(kv, without.values())
    assert lo == lo0 + int(0.03 * 20 * GiB)
    assert hi == hi0 - int(0.03 * 20 * GiB) + 3 * GiB + 12345


def test_alternative_that_lowers_the_kv_widens_the_safe_end_alone():
    alt = unc.Alternative("triton_kernels_installed", False, True, -GiB, "mxfp4.py 0.11.0")
    bands = _bands(unmodelled=(_assumed("triton_kernels_installed"),), alternatives=(alt,))
    assert unc.band_sides(bands["assumed triton_kernels_installed=false"].to_dict()) == (GiB, 0)
    assert "not modelled: triton_kernels_installed" not in bands


def test_alternative_without_effect_adds_nothing():
    alt = unc.Alternative("flashinfer_installed", False, True, 0, "x")
    bands = _bands(unmodelled=(_assumed("flashinfer_installed"),), alternatives=(alt,))
    assert unc.band_sides(bands["assumed flashinfer_installed=false"].to_dict()) == (0, 0)
    assert "not modelled: flashinfer_installed" not in bands


def test_given_kv_bytes_leave_no_alternative_band():
    alt = unc.Alternative("flashinfer_installed", False, True, GiB, "x")
    bands = _bands(kv_cache_memory_bytes=8 * GiB, alternatives=(alt,))
    assert list(bands) == ["kv_cache_memory_bytes"]


# ------------------------------------------------------------------------------------------------
# the alternative's settings (tuner/memory/assumed.py)
# ------------------------------------------------------------------------------------------------

def test_flashinfer_alternative_is_the_sampler_path_of_an_installed_package():
    era = era_for("0.11.0", "V1")
    a = alternative_settings({"name": "flashinfer_installed", "value": False}, era)
    assert a.alternative is True and a.settings == (("flashinfer_sampler", True),)
    assert "topk_topp_sampler.py 0.11.0" in a.source
    # VLLM_USE_FLASHINFER_SAMPLER=0 keeps the sort path even when installed: the alternative is the point
    off = alternative_settings({"name": "flashinfer_installed", "value": False}, era, use_flashinfer_sampler="0")
    assert off.settings == (("flashinfer_sampler", False),)


def test_triton_alternative_and_unruled_assumptions():
    era = era_for("0.11.0", "V1")
    a = alternative_settings({"name": "triton_kernels_installed", "value": False}, era)
    assert a.settings == (("triton_kernels_installed", True),)
    for name in ("compile_cache", "platform", "unified memory", "release", "device.compute_capability"):
        assert alternative_settings({"name": name, "value": "x"}, era) is None


# ------------------------------------------------------------------------------------------------
# the fit reads both sides (tuner/accuracy/uncertainty_fit.py, validate band_basis)
# ------------------------------------------------------------------------------------------------

def test_fit_judges_a_one_sided_alternative_on_its_own_side():
    from tuner.accuracy import uncertainty_fit as fit

    row = {"band_basis": {"expected_kv_bytes": 1000, "observed_kv_bytes": 1100, "tolerance_units": 0,
                          "bytes_per_unit": 1, "fixed_half_bytes": 0, "bytes": {"not_modelled": 1000},
                          "fixed_high_bytes": 120, "bytes_high": {}}}
    covered, unsafe, half = fit.judge(row, {"not_modelled": 0.03})
    assert covered and not unsafe and half == pytest.approx(100 * (30 + 120) / 2 / 1000)
    below = {"band_basis": {**row["band_basis"], "observed_kv_bytes": 960}}
    assert fit.judge(below, {"not_modelled": 0.03})[0] is False  # the safe side is the fraction alone


# ------------------------------------------------------------------------------------------------
# the job computes the alternative (real shared cases)
# ------------------------------------------------------------------------------------------------

def _case_job(shared_dir, observed_cases, case_id: str, **drop_fields):
    from tuner.accuracy.validate import case_request
    from tuner.jobs.job import run_job
    from tuner.question.protocol import JobRequest

    req = JobRequest.from_wire(case_request(observed_cases[case_id], shared_dir / "models"), required=False)
    if drop_fields:
        req = dataclasses.replace(req, drop=dataclasses.replace(req.drop, **drop_fields))
    return run_job(req.to_wire())["candidates"][0]


def _band(c: dict, name: str) -> dict:
    return next(b for b in c["bands"] if b["name"] == name)


def test_flashinfer_assumption_band_missed_the_installed_path(shared_dir, observed_cases):
    """llmd-bench-v011-h100-mistral-small-32-24b (vLLM 0.11.0, H100): the pip assumption (PyTorch's sort)
    predicts 25.22 GiB where the image (FlashInfer installed) logged 28.2 GiB, 1444 blocks; the 3 %
    fraction's high end, 27.75 GiB, missed it. The band is now exactly the installed path's effect."""
    case = "llmd-bench-v011-h100-mistral-small-32-24b"
    point = _case_job(shared_dir, observed_cases, case)
    installed = _case_job(shared_dir, observed_cases, case, flashinfer_installed=True)
    # 1450 since §24 (reserve refit to 0.1 % of the weights: 15 MiB less reserve); 1444 = the log before
    assert installed["num_gpu_blocks"] == 1450
    b = _band(point, "assumed flashinfer_installed=false")
    delta = installed["available_kv_cache_bytes"] - point["available_kv_cache_bytes"]
    assert delta > 2 * GiB
    assert unc.band_sides(b) == (0, delta)
    assert "topk_topp_sampler.py 0.11.0" in b["widened_by"]
    # the point stays at the pip assumption; the high end reaches the installed path plus the other bands
    assert point["num_gpu_blocks"] == 1296  # 1291 before §24
    others_up = sum(unc.band_sides(x)[1] for x in point["bands"] if x is not b)
    assert point["available_kv_cache_bytes_high"] == installed["available_kv_cache_bytes"] + others_up
    assert point["available_kv_cache_bytes_high"] / GiB >= 28.2
    # the low end no longer holds the input's 3 % fraction (the sort path is the larger of the two)
    assert not [x for x in point["bands"] if x["name"] == "not modelled: flashinfer_installed"]
    others_down = sum(unc.band_sides(x)[0] for x in point["bands"])
    assert point["available_kv_cache_bytes_low"] == point["available_kv_cache_bytes"] - others_down
    assert 22.6869 < point["available_kv_cache_bytes_low"] / GiB < 28.2


def test_triton_kernels_assumption_band_is_the_triton_layout(shared_dir, observed_cases):
    """vllm-27508 (gpt-oss-120b, H100, 0.11.0 inferred): MXFP4 experts on Marlin as pip installs; the
    Triton layout's KV less the point's is the band (FlashInfer's still assumed in both runs)."""
    case = "vllm-27508-h100-gpt-oss-120b-util095-mnbt1024"
    point = _case_job(shared_dir, observed_cases, case)
    triton = _case_job(shared_dir, observed_cases, case, triton_kernels_installed=True)
    delta = triton["available_kv_cache_bytes"] - point["available_kv_cache_bytes"]
    assert delta != 0
    b = _band(point, "assumed triton_kernels_installed=false")
    assert unc.band_sides(b) == ((0, delta) if delta > 0 else (-delta, 0))
    assert "mxfp4.py 0.11.0" in b["widened_by"]
    # stated, it is no assumption: neither band
    assert not [x for x in triton["bands"] if "triton_kernels_installed" in x["name"]]


def test_check_names_the_assumption_band_where_the_verdict_flips():
    """Llama-3.1-8B, H100-80GB, vLLM 0.11.0, u 0.3, 45000 tokens: does not start at the pip assumption
    (PyTorch's sort), starts with FlashInfer installed: UNCERTAIN (exit 4), the band named first."""
    from tests._cli_helpers import run_cli
    from tests.conftest import REPO

    rc, out, _err = run_cli("check", "--device", "H100-80GB", "--engine-version", "0.11.0", "--no-variants", "--",
                            "vllm", "serve", str(REPO / "configs" / "models" / "meta-llama--Llama-3.1-8B-Instruct"),
                            "--max-model-len", "45000", "--gpu-memory-utilization", "0.3")
    assert rc == 4
    terms = [line.strip() for line in out.splitlines() if line.strip().startswith("uncertain term:")]
    assert terms[0].startswith("uncertain term: assumed flashinfer_installed=false +2.950 GiB (raises the KV only) "
                               "(assumed (alternative computed); vllm/v1/sample/ops/topk_topp_sampler.py 0.11.0")
    assert not [t for t in terms if "not modelled: flashinfer_installed" in t]  # both values computed


def test_check_could_not_state_flashinfer_installed_nor_listed_the_lines_env():
    """A fresh user: ``check`` said "say flashinfer_installed: true" but had no option for it, and a
    ``VLLM_USE_FLASHINFER_SAMPLER=1`` prefix it reads was in no ``read:`` line. ``--flashinfer-installed
    true`` states it (no assumption, no band; FlashInfer's sampler: more KV than the pip assumption)."""
    from tests._cli_helpers import run_cli
    from tests.conftest import REPO

    line = ["--", "VLLM_USE_FLASHINFER_SAMPLER=1", "vllm", "serve",
            str(REPO / "configs" / "models" / "meta-llama--Llama-3.1-8B-Instruct"), "--max-model-len", "32768"]
    base = ["check", "--device", "H100-80GB", "--engine-version", "0.10.1", "--no-variants", "--json"]
    rc, out, err = run_cli(*base, *line)
    assumed = json.loads(out)
    rc2, out2, err2 = run_cli(*base, "--flashinfer-installed", "true", *line)
    stated = json.loads(out2)
    assert rc == 0 and rc2 == 0, (err, err2)
    assert assumed["read"]["env"] == {"VLLM_USE_FLASHINFER_SAMPLER": "1"}
    assert any("flashinfer_installed" in w for w in assumed["warnings"])
    assert not any("flashinfer_installed" in w for w in stated["warnings"])
    assert stated["numbers"]["num_gpu_blocks"] > assumed["numbers"]["num_gpu_blocks"]
    rc3, text, _ = run_cli(*base[:-1], "--flashinfer-installed", "true", *line)
    assert "read: VLLM_USE_FLASHINFER_SAMPLER=1 -> env VLLM_USE_FLASHINFER_SAMPLER '1'" in text.splitlines()


def test_flashinfer_sampler_env_true_answered_starts_where_vllm_fails():
    """vllm/envs.py reads VLLM_USE_FLASHINFER_SAMPLER as ``bool(int(value))``: ``true`` (or an empty
    value) stops vLLM's start-up when the sampler is built; check took it as on and said STARTS."""
    from tests._cli_helpers import run_cli
    from tests.conftest import REPO

    for value in ("true", "on"):
        rc, out, err = run_cli("check", "--device", "H100-80GB", "--engine-version", "0.11.0", "--no-variants", "--",
                               f"VLLM_USE_FLASHINFER_SAMPLER={value}", "vllm", "serve",
                               str(REPO / "configs" / "models" / "meta-llama--Llama-3.1-8B-Instruct"),
                               "--max-model-len", "32768")
        assert rc == 2, out
        assert "env.VLLM_USE_FLASHINFER_SAMPLER: vLLM reads it as bool(int(value))" in err
        assert f"{value!r} stops its start-up" in err


def test_flashinfer_sampler_off_still_named_the_installed_assumption():
    """With VLLM_USE_FLASHINFER_SAMPLER=0 the 0.8 – 0.11.0 sampler sorts whether FlashInfer is installed
    or not: no assumption to name (it said "assumed flashinfer_installed = false … widens")."""
    from tuner.memory.eras import era_for, sampler_path

    era = era_for("0.11.0", "V1")
    off = sampler_path(era, use_flashinfer_sampler="0")
    assert off.flashinfer is False and off.assumption is None
    unset = sampler_path(era)
    assert unset.flashinfer is False and unset.assumption["name"] == "flashinfer_installed"
    assert sampler_path(era, flashinfer_installed=True).flashinfer is True
