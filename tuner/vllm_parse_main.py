"""Parse a ``vllm serve`` invocation with the installed vLLM's own parser; print JSON.

Run with the interpreter that has vLLM (a worker or engine venv), never imported by the CLI or the
daemon (no vLLM in the parent): ``PYTHON tuner/vllm_parse_main.py serve [MODEL] [--config FILE] …``.
It imports nothing from ctx-tuner, so it runs in a vLLM venv without ctx-tuner installed. Output:
one JSON object of the parsed destinations ctx-tuner models (``model`` resolved from ``model_tag``
as ``vllm serve`` does), or ``{"error": …}`` with exit 2 for what vLLM's parser rejects. The seam
for a vLLM-backed :class:`tuner.serve_args.ServeParser` (engine adapter).
"""

import contextlib
import io
import json
import sys

DESTS = ("model", "max_model_len", "gpu_memory_utilization", "kv_cache_memory_bytes", "tensor_parallel_size",
         "pipeline_parallel_size", "data_parallel_size", "dtype", "kv_cache_dtype", "quantization", "max_num_seqs",
         "max_num_batched_tokens", "block_size", "enable_chunked_prefill", "enforce_eager")


def main(argv):
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm")
    ServeSubcommand().subparser_init(parser.add_subparsers(dest="subparser"))
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            ns = parser.parse_args(list(argv))
    except SystemExit:
        print(json.dumps({"error": err.getvalue().strip().splitlines()[-1:] or ["rejected"]}))
        return 2
    except ValueError as exc:
        print(json.dumps({"error": [str(exc)]}))
        return 2
    out = {k: getattr(ns, k, None) for k in DESTS}
    if getattr(ns, "model_tag", None):
        out["model"] = ns.model_tag
    print(json.dumps(out, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
