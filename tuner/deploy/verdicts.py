"""``ctx-tuner check`` on deploy files: every vLLM workload through the same check as its serve line.

Each :class:`~tuner.deploy.Workload` (:func:`tuner.deploy.read_deploy_file`) is checked by
:func:`tuner.reports.check.run_check` with its argument list, its ``--config`` file, its environment's
``VLLM_*`` variables on the not-modelled list (:func:`tuner.question.vllm_args.env_not_modelled`), and its
device: the GPU product the manifest schedules it on (``nvidia.com/gpu.product``), else the
``--device`` given. Where the manifest gives the pod (or the container's ``CUDA_VISIBLE_DEVICES``
shows) fewer GPUs than the engine's world size (``tensor_parallel_size × pipeline_parallel_size``),
the verdict is vLLM's refusal (``vllm/config/parallel.py`` ``ParallelConfig.__post_init__``, 0.13.0+:
"World size (N) is larger than the number of available GPUs (G) in this node";
:func:`tuner.memory.engine_checks.world_size_refusal`), whatever the memory says.

Exit code of a run: the worst workload's, in the order 3 (does not start) > 4 (uncertain: the
verdict flips inside the interval, :data:`tuner.reports.check.EXIT_UNCERTAIN`) > 2 (invalid input) > 1 (the
job failed) > 0 (starts).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from tuner.reports.check import EXIT_DOES_NOT_START, EXIT_FAILED, EXIT_INVALID, EXIT_STARTS, EXIT_UNCERTAIN
from tuner.deploy import Workload

#: Which exit code wins when workloads disagree (first = worst).
EXIT_PRECEDENCE = (EXIT_DOES_NOT_START, EXIT_UNCERTAIN, EXIT_INVALID, EXIT_FAILED, EXIT_STARTS)


def worst_exit(codes: Sequence[int]) -> int:
    """The exit code of several workloads: the first of :data:`EXIT_PRECEDENCE` among them."""
    for code in EXIT_PRECEDENCE:
        if code in codes:
            return code
    return EXIT_STARTS


@dataclass
class WorkloadVerdict:
    """One workload's answer: ``exit_code``, the check's document (``doc``; None when the input
    was invalid or the job failed), or the ``error`` text."""

    workload: Workload
    exit_code: int
    doc: dict | None = None
    error: str | None = None
    error_type: str | None = None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        verdict = (self.doc or {}).get("verdict") or ("invalid input" if self.exit_code == EXIT_INVALID else "failed")
        return {"where": self.workload.where, "workload": self.workload.to_dict(), "exit_code": self.exit_code,
                "verdict": verdict, "error": self.error, "error_type": self.error_type, "notes": list(self.notes),
                "check": self.doc}


def workload_device(w: Workload, device: Any) -> tuple[Any, list[str]]:
    """The device a workload is checked on: the manifest's GPU product when it names a catalog
    card, else ``device`` (``--device``)."""
    from tuner.memory import devices
    from tuner.errors import DeviceError

    if w.gpu_product:
        known = devices.lookup(w.gpu_product)
        if known is None:
            if not isinstance(device, Mapping):
                # a verdict on another card would be wrong: only a card stated with its memory
                # (--device NAME:GIB) stands in for a product the catalog does not know
                raise DeviceError(f"the manifest's GPU product {w.gpu_product!r} names no catalog card "
                                  f"({devices.unknown_message(w.gpu_product)}); state that card with its memory: "
                                  "--device NAME:GIB" + (f" (--device {device} names another card)"
                                                         if device not in (None, "auto") else ""), where=w.where)
            return device, [f"GPU product {w.gpu_product!r} from the manifest names no catalog card: checked as "
                            f"--device {device.get('name')} states it"]
        note = f"device {known.name}: the manifest's GPU product {w.gpu_product!r}"
        if device is not None and device != "auto":
            note += f" (it wins over --device {device})"
        return known.name, [note]
    return device, []


#: A vLLM image tag that names a release: ``v0.19.0``, ``0.10.1.1``, ``v0.11.0-cu128`` (vllm/vllm-openai,
#: vllm-cpu, the llm-d and KServe vLLM images tag their releases so); ``latest``, ``nightly`` and
#: digests name none.
_RELEASE_TAG = re.compile(r"^v?(\d+\.\d+\.\d+(?:\.\d+)?)(?:$|[-+_.](?!\d))")


def image_release(image: str | None) -> str | None:
    """The vLLM release a vLLM image's tag names (``vllm/vllm-openai:v0.19.0`` -> ``0.19.0``), else None."""
    from tuner.deploy.commandline import is_vllm_image

    if not image or not is_vllm_image(image):
        return None
    name = str(image).split("@")[0]
    tag = name.rsplit(":", 1)[1] if ":" in name.rsplit("/", 1)[-1] else ""
    m = _RELEASE_TAG.match(tag)
    return m.group(1) if m else None


def workload_gpus(w: Workload) -> tuple[int | None, str | None]:
    """The GPUs the workload's vLLM sees: the pod's GPU limit, fewer where the container's
    ``CUDA_VISIBLE_DEVICES`` shows fewer (:func:`tuner.memory.engine_checks.visible_gpu_count`), and
    what decided it (None, None: the manifest does not say)."""
    from tuner.memory.engine_checks import visible_gpu_count

    cvd = (w.env or {}).get("CUDA_VISIBLE_DEVICES")
    visible = visible_gpu_count(str(cvd)) if cvd is not None else None
    if visible is not None and (w.gpus is None or visible < w.gpus):
        return visible, f"the container's CUDA_VISIBLE_DEVICES={cvd} shows {visible} GPU(s)"
    if w.gpus is not None:
        return w.gpus, f"the manifest gives the pod {w.gpus} GPU(s)"
    return None, None


def gpu_count_refusal(w: Workload, values: dict, ignored: Sequence[dict] = (), *,
                      version: tuple = (0, 34, 0)) -> str | None:
    """vLLM's refusal when the pod (or its ``CUDA_VISIBLE_DEVICES``) shows fewer GPUs than the
    world size (None when it shows enough or the manifest does not say, or the engine spans nodes:
    ``--distributed-executor-backend ray`` or ``--nnodes`` > 1, which the check's ``ignored`` list
    holds); :func:`tuner.memory.engine_checks.world_size_refusal` words it per release."""
    from tuner.memory.engine_checks import spans_nodes, world_size_refusal

    gpus, _ = workload_gpus(w)
    if gpus is None or spans_nodes(ignored):
        return None
    world = int(values.get("tensor_parallel_size") or 1) * int(values.get("pipeline_parallel_size") or 1)
    return world_size_refusal(world, gpus, version=version)


def check_workload(w: Workload, *, device: Any = None, run: Callable[..., Any] | None = None,
                   **kw: Any) -> WorkloadVerdict:
    """Check one workload (``kw`` go to :func:`tuner.reports.check.run_check`); never raises for input or
    job errors: they become the verdict."""
    from tuner.reports.check import run_check
    from tuner.errors import DeviceError, DropError, EraError, ModelConfigError, TunerError
    from tuner.memory.serve_args import ServeArgsError
    from tuner.question.vllm_args import ArgsInputError, env_not_modelled, modelled_env

    run = run or run_check
    try:
        dev, notes = workload_device(w, device)
        release = image_release(w.image)
        if release and kw.get("engine_version") is None:  # the image names the release it runs
            kw = {**kw, "engine_version": release}
            notes.append(f"vLLM {release}: the release the image {w.image} is tagged with (--engine-version wins)")
        env_nm, env_ignored = env_not_modelled(w.env, source=w.where)
        env = modelled_env(w.env)
        res = run(list(w.argv), config_file=w.config_file, device=dev, extra_not_modelled=env_nm, label=w.where,
                  notes=list(w.notes) + notes, **({"env": env} if env else {}), **kw)
    except (ServeArgsError, ArgsInputError, DropError, DeviceError, EraError, ModelConfigError) as exc:
        return WorkloadVerdict(w, EXIT_INVALID, error=str(exc), error_type=type(exc).__name__, notes=list(w.notes))
    except TunerError as exc:
        return WorkloadVerdict(w, EXIT_FAILED, error=str(exc), error_type=type(exc).__name__, notes=list(w.notes))
    doc = res.doc
    doc["read"]["ignored"] = list(doc["read"].get("ignored") or []) + env_ignored + list(w.ignored)
    code = res.exit_code
    refusal = gpu_count_refusal(w, {**(doc.get("drop") or {}), **(doc["read"].get("values") or {})},
                                doc["read"]["ignored"], version=_version(doc.get("engine_version")))
    if refusal is not None:
        doc.update(verdict="does not start", starts=False, engine_error=refusal, nearest=[])
        doc["warnings"].append(f"{workload_gpus(w)[1]}; vLLM refuses a larger world size "
                               "(vllm/config/parallel.py ParallelConfig.__post_init__); the memory "
                               "figures are those of a pod with enough GPUs")
        code = EXIT_DOES_NOT_START
    elif w.gpus is not None:
        world = int(doc["read"]["values"].get("tensor_parallel_size") or 1) * \
            int(doc["read"]["values"].get("pipeline_parallel_size") or 1)
        dp = int(doc["read"]["values"].get("data_parallel_size") or 1)
        if w.gpus > world * dp:
            doc["warnings"].append(f"the pod asks for {w.gpus} GPUs; the engine uses {world * dp} "
                                   "(tensor × pipeline × data parallel)")
    return WorkloadVerdict(w, code, doc=doc)


def _version(text: Any) -> tuple:
    from tuner.memory.eras import parse_version

    v = parse_version(str(text or "0.34.0"))
    return (v.major, v.minor, v.patch)


def check_files(paths: Sequence[str], *, device: Any = None, environ: dict | None = None,
                skip_non_vllm: bool = False, skipped: list | None = None,
                **kw: Any) -> tuple[list[WorkloadVerdict], int]:
    """Every workload of every file (a file that cannot be read is one invalid-input verdict).
    ``skip_non_vllm`` (hooks on every changed YAML file): a file that is no deploy format ctx-tuner
    reads, or has no vLLM container, is appended to ``skipped`` as ``(file, why)`` instead."""
    from tuner.deploy import DeployFileError, detect_format, load_documents, read_deploy_file

    out: list[WorkloadVerdict] = []
    for p in paths:
        try:
            found = read_deploy_file(p, environ=environ)
        except DeployFileError as exc:
            if skip_non_vllm and skipped is not None:
                try:
                    fmt = detect_format(load_documents(p))
                except DeployFileError:
                    fmt = None  # unreadable or not YAML: still an error
                if fmt is not None and (fmt == "unknown" or "no vLLM container" in exc.message):
                    skipped.append((p, exc.message))
                    continue
            out.append(WorkloadVerdict(Workload(file=p, path="", argv=[], kind="?"), EXIT_INVALID, error=str(exc),
                                       error_type=type(exc).__name__))
            continue
        for w in found:
            out.append(check_workload(w, device=device, **kw))
    return out, worst_exit([v.exit_code for v in out])


def render(verdicts: Sequence[WorkloadVerdict]) -> str:
    """The human-readable answer: one section per workload (its place in the file first)."""
    from tuner.reports.check import CheckResult, render as render_check

    parts = []
    for v in verdicts:
        head = f"== {v.workload.where}" + (f" ({v.workload.format}, {v.workload.kind})" if v.workload.format else "")
        if v.doc is None:
            body = ["INVALID INPUT" if v.exit_code == EXIT_INVALID else "FAILED", f"  {v.error}"]
            body += [f"note: {n}" for n in v.notes]
            parts.append("\n".join([head, *body, f"exit {v.exit_code}"]))
            continue
        text = render_check(CheckResult(v.doc["starts"], v.doc))
        parts.append("\n".join([head, text, f"exit {v.exit_code}"]))
    codes = [v.exit_code for v in verdicts]
    summary = (f"{len(verdicts)} workload(s): " + ", ".join(
        f"{sum(1 for c in codes if c == k)} {name}" for k, name in ((EXIT_STARTS, "start"),
                                                                   (EXIT_DOES_NOT_START, "do not start"),
                                                                   (EXIT_UNCERTAIN, "uncertain"),
                                                                   (EXIT_INVALID, "invalid input"),
                                                                   (EXIT_FAILED, "failed")) if k in codes)
        + f"; exit {worst_exit(codes)}")
    return "\n\n".join(parts + [summary])
