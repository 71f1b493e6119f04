"""The question as asked and the answer's typed contract: a drop and its fields (``drop``), the
mapping between drop fields and vLLM's arguments (``vllm_args``), the proposal in vLLM's argument
forms (``vllm_forms``), the one typed contract across the worker seam (``protocol``) and the JSON
forms that keep tuples and non-string keys (``wirejson``).

May import :mod:`tuner.memory`, :mod:`tuner.releases`, :mod:`tuner.errors`. No torch, no vLLM.
"""
