"""vLLM's memory model, release by release: eras and their budget formula (``eras``,
``budget``), KV cache arithmetic (``kvcache``), quantized weight layouts (``quant``), speculative
decoding (``specdecode``), the caching allocator (``allocator``), devices and platforms
(``devices``, ``platforms``), the attention backend a layer runs and its buffers (``attention``), the
`vllm serve` arguments (``serve_args``), vLLM's start-up checks (``engine_checks``), the uncertainty bands by source (``uncertainty``), the ledger and the proposal
(``ledger``) and the search for the largest ``max_model_len`` that starts (``search``).

Pure: no torch, no vLLM, no I/O beyond the package's data files. May import :mod:`tuner.releases`
and :mod:`tuner.errors`.
"""
