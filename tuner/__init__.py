"""ctx-tuner: predict the largest vLLM ``max_model_len`` that fits, before the engine starts.

The package is split so that the daemon's main process never imports torch:
pure memory-model modules (``eras``, ``kvcache``, ``budget``, ``search``) hold no I/O and no torch;
torch lives only in worker-side modules (``simulate``, ``tracker``, ``worker``) and in plugins.
"""

__version__ = "0.1.0"
