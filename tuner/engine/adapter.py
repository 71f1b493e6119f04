"""One engine session per job: the installed vLLM asked for its config, KV specs and KV sizing.

Imported only where ``vllm`` is importable (worker side; ``tuner.engine.vllm_importable``). The
session costs one ``import vllm`` (about 5–15 s) and one ``EngineArgs.create_engine_config()``
(0.1–2 s, 9–25 s the first time vLLM inspects an architecture; it caches that under
``VLLM_CACHE_ROOT``); the model is then built once on the ``meta`` device (no weight memory) and
its KV cache specs read once. Sizing calls (``kv_cache_utils.get_kv_cache_configs``) take
milliseconds each.

What it asks vLLM (the release installed in this Python):

1. ``EngineArgs(model=DIR, load_format="dummy", skip_tokenizer_init=True, ...)`` with the drop's
   settings → ``create_engine_config()``: the release's defaults for ``max_num_batched_tokens``,
   ``max_num_seqs``, chunked prefill and block size, the quantization method it resolves, the
   derived ``max_model_len``; a refusal is vLLM's own message, raised as a :class:`DropError`
   naming the drop field it concerns.
2. ``initialize_model`` under ``torch.device("meta")`` → the runner's ``get_kv_cache_spec`` (the
   ``GPUModelRunner`` method, which the CPU runner inherits) and the parameters' bytes by dtype.
3. ``get_kv_cache_configs`` (vllm/v1/core/kv_cache_utils.py) for given available bytes →
   ``num_gpu_blocks`` and the max concurrency, or vLLM's refusal with its estimated maximum length.

Corrections for the CPU build (``vllm-cpu``; each measured, see docs/engine-adapter.md):
the GPU era's block size is passed explicitly (the CPU platform defaults to 128); each layer with
the CPU attention backend gets the FlashAttention backend class (its static methods only) before
specs are read, so sliding-window and hybrid blocks are not rounded to the CPU kernel's multiple
of 32; ``update_block_size_for_backend`` aligns hybrid attention/state pages as the executor does
after ``load_model``; from 0.32 the KV cache layout is resolved and recorded; multimodal
checkpoints are built with ``language_model_only=True``; the distributed state is a world of one
(gloo) and tensor parallelism is faked by the TP group's size.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tuner.errors import DropError, EngineError

#: Drop fields named in vLLM's refusals, matched against the message (first match wins).
_FIELDS = ("max_model_len", "max_num_batched_tokens", "max_num_seqs", "tensor_parallel_size",
           "pipeline_parallel_size", "kv_cache_dtype", "quantization", "block_size", "dtype")
#: How vLLM's messages spell some fields.
_ALIASES = {"max seq len": "max_model_len", "max-model-len": "max_model_len", "quant_method": "quantization",
            "quantization method": "quantization", "tensor parallel": "tensor_parallel_size"}

#: The import-only ``torchvision`` stub directory put on ``PYTHONPATH`` for multimodal checkpoints
#: when torchvision is not importable (its binary ops do not load with the CPU build's torch).
STUB_DIR = Path(__file__).with_name("stubs")


def drop_field_of(message: str) -> str:
    """The drop field a vLLM refusal concerns (``model`` when none is named)."""
    low = message.lower()
    for name in _FIELDS:
        if name in low:
            return name
    for text, name in _ALIASES.items():
        if text in low:
            return name
    return "model"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _prepare_env(multimodal: bool) -> None:
    """Environment for an in-process, offline, single-rank engine (set before ``import vllm``)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if multimodal:
        import importlib.util

        if importlib.util.find_spec("torchvision") is None and STUB_DIR.is_dir():
            # vLLM inspects architectures in a subprocess: only PYTHONPATH reaches it.
            parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
            if str(STUB_DIR) not in parts:
                os.environ["PYTHONPATH"] = os.pathsep.join([str(STUB_DIR), *parts])
            if str(STUB_DIR) not in sys.path:
                sys.path.insert(0, str(STUB_DIR))


@dataclass
class EngineSettings:
    """The drop's engine arguments as vLLM's ``EngineArgs`` names them (None = vLLM's default)."""

    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    quantization: str | None = None
    tensor_parallel_size: int = 1
    max_model_len: int | None = None
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    enable_chunked_prefill: bool | None = None
    block_size: int = 16
    trust_remote_code: bool = False
    multimodal: bool = False
    #: the drop's ``hf_overrides`` (vLLM ``EngineArgs.hf_overrides``), None = none
    hf_overrides: dict | None = None


@dataclass
class EngineSession:
    """One engine (config + meta model + KV specs) for one job. Create with :func:`open_session`."""

    model_dir: str
    settings: EngineSettings
    path: str | None
    version: str
    vllm_config: Any
    timings: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)
    _specs: dict | None = None
    _weights: dict | None = None

    # -- (1) the engine config -------------------------------------------------------------------

    def config_report(self) -> dict:
        """What the engine config decided: defaults, quantization, derived length, platform."""
        vc = self.vllm_config
        mc, sc, cc = vc.model_config, vc.scheduler_config, vc.cache_config
        from vllm.platforms import current_platform

        return {
            "release": self.version, "platform": str(getattr(current_platform, "device_name", "?")),
            "max_model_len": int(mc.max_model_len), "max_num_batched_tokens": int(sc.max_num_batched_tokens),
            "max_num_seqs": int(sc.max_num_seqs), "enable_chunked_prefill": bool(sc.enable_chunked_prefill),
            "block_size": int(cc.block_size), "quantization": mc.quantization,
            "dtype": str(mc.dtype).replace("torch.", ""), "kv_cache_dtype": str(cc.cache_dtype),
            "architectures": list(getattr(mc, "architectures", None) or []),
            "is_hybrid": bool(getattr(mc, "is_hybrid", False)),
        }

    def batch_defaults(self, *, device_name: str, total_memory_bytes: int, entry_point: str = "serve") -> dict:
        """The release's own defaults of ``max_num_batched_tokens`` / ``max_num_seqs`` for the
        drop's GPU: ``EngineArgs.get_batch_defaults`` (vllm/engine/arg_utils.py) asked as on a
        CUDA platform with that device's name and total memory (the CPU build would otherwise
        answer its own platform's defaults), for the usage context of the entry point
        (``serve`` → OPENAI_API_SERVER, ``offline`` → LLM_CLASS); ``block_size`` and
        ``enable_chunked_prefill`` are the engine config's (after the backend's block alignment).
        Where the release has no such classmethod (older layouts) the batch keys are None."""
        from unittest import mock

        from vllm.engine.arg_utils import EngineArgs
        from vllm.platforms import current_platform

        vc = self.vllm_config
        out: dict = {"max_num_batched_tokens": None, "max_num_seqs": None,
                     "enable_chunked_prefill": bool(vc.scheduler_config.enable_chunked_prefill),
                     "block_size": int(vc.cache_config.block_size),
                     "source": "vllm/engine/arg_utils.py EngineArgs.get_batch_defaults"}
        getter = getattr(EngineArgs, "get_batch_defaults", None)
        if getter is None:
            out["source"] = "not available in this release"
            return out
        from vllm.usage.usage_lib import UsageContext

        world = int(self.settings.tensor_parallel_size)
        patches = [mock.patch.object(type(current_platform), "get_device_total_memory",
                                     classmethod(lambda cls, device_id=0: int(total_memory_bytes))),
                   mock.patch.object(type(current_platform), "get_device_name",
                                     classmethod(lambda cls, device_id=0: str(device_name))),
                   mock.patch.object(type(current_platform), "is_cpu", lambda self=None: False),
                   mock.patch.object(type(current_platform), "is_tpu", lambda self=None: False)]
        with contextlib.ExitStack() as stack:
            for p in patches:
                stack.enter_context(p)
            n_by, s_by = getter(world)
        ctx = UsageContext.LLM_CLASS if entry_point == "offline" else UsageContext.OPENAI_API_SERVER
        from vllm.config import SchedulerConfig

        out["max_num_batched_tokens"] = int(n_by.get(ctx, getattr(SchedulerConfig, "DEFAULT_MAX_NUM_BATCHED_TOKENS", 0)))
        out["max_num_seqs"] = int(s_by.get(ctx, getattr(SchedulerConfig, "DEFAULT_MAX_NUM_SEQS", 0)))
        return out

    # -- (2) the model on meta, its KV specs and weights -----------------------------------------

    def _build(self) -> None:
        if self._specs is not None:
            return
        import torch
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.utils import initialize_model
        from vllm.platforms import current_platform
        from vllm.utils.torch_utils import set_default_torch_dtype

        vc = self.vllm_config
        t0 = time.perf_counter()
        try:
            with set_current_vllm_config(vc):
                _init_single_rank(vc, self.settings.tensor_parallel_size)
                with set_default_torch_dtype(vc.model_config.dtype), torch.device("meta"):
                    model = initialize_model(vllm_config=vc, model_config=vc.model_config)
                self.timings["build_s"] = round(time.perf_counter() - t0, 3)
                self._weights = _weights_by_dtype(model)
                swapped = _swap_cpu_attention_backends(vc)
                if swapped:
                    self.notes.append(f"{swapped} CPU_ATTN layers read with the FLASH_ATTN backend class")
                current_platform.update_block_size_for_backend(vc)
                t1 = time.perf_counter()
                self._specs = _runner_kv_cache_spec(vc)
                _resolve_layout(vc, self._specs)
                self.timings["spec_s"] = round(time.perf_counter() - t1, 4)
        except DropError:
            raise
        except Exception as exc:  # vLLM cannot build this model here: the job says so, never hides it
            raise EngineError(f"vLLM {self.version} could not build the model on meta: {type(exc).__name__}: "
                              f"{str(exc).splitlines()[0] if str(exc) else ''}", where=self.model_dir) from exc

    def kv_cache_specs(self) -> dict:
        """vLLM's own ``{layer name: KVCacheSpec}`` of the (only) rank."""
        self._build()
        return self._specs

    def weights(self) -> dict:
        """``{"bytes": int, "by_dtype": {dtype: bytes}, "params": int}`` of the meta model's
        parameters and buffers (each storage once), as loaded before
        ``process_weights_after_loading`` (quantized layouts as the checkpoint stores them)."""
        self._build()
        return self._weights

    # -- (3) vLLM's own KV sizing ----------------------------------------------------------------

    def kv_sizing(self, available_bytes: int, max_model_len: int) -> dict:
        """``get_kv_cache_configs`` for ``available_bytes`` and ``max_model_len``:
        ``{"num_gpu_blocks", "max_concurrency", "starts": True}`` or ``{"starts": False, "error":
        vLLM's message, "estimated_max_model_len": int | None}``."""
        import re

        from vllm.config import set_current_vllm_config
        from vllm.v1.core import kv_cache_utils as kcu

        specs = self.kv_cache_specs()
        vc = self.vllm_config
        old = vc.model_config.max_model_len
        vc.model_config.max_model_len = int(max_model_len)
        try:
            with set_current_vllm_config(vc):
                cfg = kcu.get_kv_cache_configs(vc, [specs], [int(available_bytes)])[0]
                conc = kcu.get_max_concurrency_for_kv_cache_config(vc, cfg)
            return {"starts": True, "num_gpu_blocks": int(cfg.num_blocks), "max_concurrency": round(float(conc), 4),
                    "num_groups": len(cfg.kv_cache_groups)}
        except ValueError as exc:
            msg = str(exc)
            m = re.search(r"estimated maximum model length is (\d+)", msg)
            return {"starts": False, "error": msg, "estimated_max_model_len": int(m.group(1)) if m else None}
        finally:
            vc.model_config.max_model_len = old


def _init_single_rank(vc: Any, tp: int) -> None:
    """A distributed world of one rank (gloo), then the TP group's size faked to ``tp`` so the
    model is built as one rank of a TP group."""
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        from vllm.v1.worker.gpu_worker import init_worker_distributed_environment

        pc = vc.parallel_config
        saved = (pc.tensor_parallel_size, pc.world_size)
        pc.tensor_parallel_size, pc.world_size = 1, 1
        try:
            init_worker_distributed_environment(vc, 0, f"tcp://127.0.0.1:{_free_port()}", 0, "gloo")
        finally:
            pc.tensor_parallel_size, pc.world_size = saved
    # set every time: one process may open sessions of different TP sizes
    parallel_state.get_tp_group().world_size = tp
    vc.parallel_config.tensor_parallel_size = tp


def _weights_by_dtype(model: Any) -> dict:
    seen: set = set()
    by: dict[str, int] = {}
    params = 0
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) in seen:
            continue
        seen.add(id(t))
        n = int(t.numel()) * int(t.element_size())
        key = str(t.dtype).replace("torch.", "")
        by[key] = by.get(key, 0) + n
        params += int(t.numel())
    return {"bytes": sum(by.values()), "by_dtype": dict(sorted(by.items())), "params": params}


def _swap_cpu_attention_backends(vc: Any) -> int:
    """Give every attention layer on the CPU backend the FlashAttention backend class (only its
    static methods are used for specs); returns how many layers were changed."""
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    from vllm.config import get_layers_from_vllm_config

    try:
        from vllm.v1.attention.backends.registry import AttentionBackendEnum
    except ImportError:  # older layout
        from vllm.attention.backends.registry import AttentionBackendEnum  # type: ignore[no-redef]
    flash = None
    n = 0
    for layer in get_layers_from_vllm_config(vc, AttentionLayerBase).values():
        backend = getattr(layer, "attn_backend", None)
        if backend is None or not hasattr(backend, "get_name"):
            continue
        try:
            name = backend.get_name()
        except Exception:
            continue
        if name == "CPU_ATTN":
            if flash is None:
                flash = AttentionBackendEnum.FLASH_ATTN.get_class()
            layer.attn_backend = flash
            n += 1
    return n


def _runner_kv_cache_spec(vc: Any) -> dict:
    """The model runner's ``get_kv_cache_spec`` (``GPUModelRunner``'s, inherited by the CPU
    runner) for the layers registered in the config's forward context. It reads only the config
    and the layers, so it is called on a bare holder instead of a runner (a runner allocates
    input buffers of ``max_num_seqs × max_model_len``)."""
    from types import SimpleNamespace

    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    holder = SimpleNamespace(vllm_config=vc, shared_kv_cache_layers={}, kv_sharing_fast_prefill_eligible_layers=set())
    return dict(GPUModelRunner.get_kv_cache_spec(holder, ))


def _resolve_layout(vc: Any, specs: dict) -> None:
    """0.32+: register the spec classes and resolve + record the KV cache layout, as the engine
    core does before sizing (older releases have neither step)."""
    try:
        from vllm.v1.attention.backends.utils import (get_supported_kv_cache_layouts, record_kv_cache_layout,
                                                      resolve_kv_cache_layout)
    except ImportError:  # before 0.32: no layout to resolve
        return
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs

    register_all_kvcache_specs(vc)
    if vc.cache_config.kv_cache_layout is None:
        backends = {layer.get_attn_backend() for layer in get_layers_from_vllm_config(vc, AttentionLayerBase).values()}
        names = [x.name for x in get_supported_kv_cache_layouts(sorted(backends, key=lambda b: b.__name__))]
        layout = resolve_kv_cache_layout(vc, [names], specs.values())
        record_kv_cache_layout(vc.cache_config, layout.name)


def open_session(model_dir: str, settings: EngineSettings, *, path: str | None = None) -> EngineSession:
    """Import vLLM and build the engine config for ``settings``.

    Raises:
        DropError: vLLM refuses the settings (its own message; ``field`` is the drop key it names).
        EngineError: vLLM cannot be imported or fails for another reason.
    """
    t0 = time.perf_counter()
    _prepare_env(settings.multimodal)
    try:
        import vllm
        from vllm.engine.arg_utils import EngineArgs
    except Exception as exc:
        raise EngineError(f"import vllm failed: {type(exc).__name__}: {exc}", where="vllm") from exc
    timings = {"import_s": round(time.perf_counter() - t0, 3)}
    kw: dict[str, Any] = dict(model=model_dir, load_format="dummy", skip_tokenizer_init=True, enforce_eager=True,
                              dtype=settings.dtype, kv_cache_dtype=settings.kv_cache_dtype,
                              quantization=settings.quantization, tensor_parallel_size=settings.tensor_parallel_size,
                              max_model_len=settings.max_model_len, max_num_batched_tokens=settings.max_num_batched_tokens,
                              max_num_seqs=settings.max_num_seqs, enable_chunked_prefill=settings.enable_chunked_prefill,
                              block_size=settings.block_size, trust_remote_code=settings.trust_remote_code,
                              kv_cache_memory_bytes=1 << 30, distributed_executor_backend="uni")
    if settings.multimodal:
        kw["language_model_only"] = True
    if settings.hf_overrides:
        kw["hf_overrides"] = dict(settings.hf_overrides)
    t1 = time.perf_counter()
    try:
        with contextlib.redirect_stdout(sys.stderr):
            vc = EngineArgs(**kw).create_engine_config()
    except Exception as exc:
        msg = str(exc).strip()
        if not isinstance(exc, ValueError) or len(msg) < 40:  # e.g. a KeyError of a partial config: say which
            msg = f"{type(exc).__name__}: {msg}"
        first = " ".join(msg.split())[:600]
        if "failed to be inspected" in msg or "not supported for now" in msg:
            raise EngineError(f"vLLM {vllm.__version__} could not inspect the architecture: {first}",
                              where=model_dir) from exc
        raise DropError(f"vLLM {vllm.__version__} refuses these settings: {first}", path=path,
                        field=drop_field_of(msg)) from exc
    timings["config_s"] = round(time.perf_counter() - t1, 3)
    return EngineSession(model_dir, settings, path, str(vllm.__version__), vc, timings)
