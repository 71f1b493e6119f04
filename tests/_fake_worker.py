"""A stand-in for ``python -m tuner.commands.worker_main`` in daemon tests: fast, no torch.

Invoked as ``python -S tests/_fake_worker.py -m tuner.commands.worker_main`` (the daemon's
``worker_python`` is a wrapper script), it reads the real JSON request on stdin and replies in the
worker's format with numbers derived from the request. Behaviour by drop name prefix:
``crash`` (dies by SIGKILL after writing to stderr), ``hang`` (sleeps forever, with a child in the
same process group), ``slow`` (sleeps ``$FAKE_SLOW_S`` seconds, default 3, then replies; with ``$FAKE_SLOW_ONCE_DIR`` only
the first run of each drop sleeps),
``typed`` (replies with a typed error), ``warn`` (replies with two warnings), ``hog`` (allocates
``$FAKE_HOG_BYTES`` bytes, default 4 GiB). ``$FAKE_WORKER_LOG``, if set, gets one line per request.
Like the real worker it first applies :func:`tuner.seam.worker_guard.install` (dies with its parent, own
deadline, memory limit).
"""

import json
import os
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tuner.seam.worker_guard import install  # noqa: E402  (stdlib only: the real worker's first step)



def answer(req):
    d = req["drop"]
    name = d["name"]
    if os.environ.get("FAKE_WORKER_LOG"):
        with open(os.environ["FAKE_WORKER_LOG"], "a") as fh:
            fh.write(f"{os.getpid()} {name} {d['content_sha256']}\n")
    if name.startswith("crash"):
        sys.stderr.write("CUDA out of memory. Tried to allocate 20.00 GiB\n")
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    if name.startswith("hang"):
        subprocess.Popen([sys.executable, "-S", "-c", "import time; time.sleep(3600)"])
        time.sleep(3600)
    if name.startswith("slow"):
        once = os.environ.get("FAKE_SLOW_ONCE_DIR")  # with a directory: only each drop's first run is slow
        marker = os.path.join(once, name) if once else None
        if marker is None or not os.path.exists(marker):
            if marker is not None:
                open(marker, "w").close()
            time.sleep(float(os.environ.get("FAKE_SLOW_S", "3")))
    if name.startswith("hog"):
        once = os.environ.get("FAKE_HOG_ONCE")  # a marker file: only the first run allocates
        if not once or not os.path.exists(once):
            if once:
                open(once, "w").close()
            hog = bytearray(int(os.environ.get("FAKE_HOG_BYTES", str(4 << 30))))  # MemoryError past the limit
    if name.startswith("typed"):
        return {"ok": False, "error_type": "PluginError", "error": "plugin generic: no architecture"}

    total = int(req["device"]["total_memory_bytes"])
    weights, act, non_torch = 1 << 30, 1 << 28, 1 << 28
    page = 32768  # bytes per block of 16 tokens
    N = d.get("max_num_batched_tokens") or 8192
    run = {"key": "r", "max_num_batched_tokens": N, "num_reqs": 64, "pp_rank": 0, "max_num_seqs": 64,
           "weights_bytes": weights, "activation_peak_bytes": act, "forward_peak_bytes": act,
           "sampler_peak_bytes": 1 << 20, "elapsed_s": 0.001}
    cands, props = [], []
    lens = d["candidates"].get("max_model_len") or [4096]
    for u in d["candidates"]["gpu_memory_utilization"]:
        requested = int(total * u)
        avail = requested - weights - act - non_torch
        blocks = max(avail // page, 0)
        tokens = blocks * 16
        for m in lens:
            cands.append({"gpu_memory_utilization": u, "max_model_len": m, "max_num_batched_tokens": N,
                          "max_num_seqs": 64, "fits": tokens >= m, "reason": None if tokens >= m else "too long",
                          "requested_memory_bytes": requested, "weights_bytes": weights, "activation_peak_bytes": act,
                          "non_torch_bytes": non_torch, "cuda_graph_bytes": 0, "available_kv_cache_bytes": avail,
                          "num_gpu_blocks": blocks, "kv_cache_tokens": tokens, "max_concurrency": tokens / m,
                          "run_key": "r"})
        best = min(tokens, 131072) // 16 * 16
        props.append({"gpu_memory_utilization": u, "max_model_len": best, "num_gpu_blocks": blocks,
                      "kv_cache_tokens": tokens, "max_concurrency": tokens / best if best else 0.0, "reason": None,
                      "vllm_args": f"--max-model-len {best} --gpu-memory-utilization {u:g}",
                      # the proposed point's own numbers, as the real worker's search gives them
                      "max_num_batched_tokens": N, "requested_memory_bytes": requested, "weights_bytes": weights,
                      "activation_peak_bytes": act, "non_torch_bytes": non_torch, "cuda_graph_bytes": 0,
                      "available_kv_cache_bytes": avail})
    result = {"model": {"config_sha256": "f" * 64, "architectures": ["LlamaForCausalLM"]}, "plugin": "fake",
              "warnings": (["no plugin serves FooForCausalLM; using generic",
                            "config.json lacks head_dim; using 128 (default of plugin generic)"]
                           if name.startswith("warn") else []), "era": "V1 0.19.0 (fake)", "dtype": "bfloat16", "block_size": 16,
              "versions": {"tool": "0.1.0", "torch": None, "transformers": None},
              "runs": [run], "candidates": cands, "proposals": props}
    return {"ok": True, "protocol": 1, "result": result}  # tuner.question.protocol.PROTOCOL_VERSION


if "--serve" in sys.argv[1:]:  # the daemon's warm worker: one request per line, per-job deadline
    import threading

    from tuner.seam.worker_guard import kill_own_group

    install(pdeathsig=lambda _sig: True)
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        limit = float(req.pop("deadline_s", 0) or 0)
        timer = threading.Timer(limit, kill_own_group) if limit > 0 else None
        if timer is not None:
            timer.daemon = True
            timer.start()
        reply = answer(req)
        if timer is not None:
            timer.cancel()
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()
else:
    install()
    json.dump(answer(json.loads(sys.stdin.read())), sys.stdout)
