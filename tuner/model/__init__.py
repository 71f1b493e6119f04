"""The model side: the model spec read from a config (``modelspec``, ``hub``, ``modelroots``), the
plugin contract and the kit plugins are written with (``plugin``, ``kit``), lean imports of torch
and transformers (``torch_lean``, ``transformers_lean``) and the profile passes simulated with fake
tensors (``simulate``).

May import :mod:`tuner.memory`, :mod:`tuner.releases`, :mod:`tuner.errors`. Only ``simulate`` and the
lean imports touch torch, and only inside the worker.
"""
