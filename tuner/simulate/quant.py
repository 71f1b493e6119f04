"""Quantized-checkpoint weights (placeholder: filled in by the quantization work of issue 7).

:func:`scheme_for` returns ``None`` (16-bit weights everywhere) until schemes are implemented.
A scheme object implements ``make_linear_weights(module, in_features, out_features, dtype, prefix)
-> bool``: register the layer's quantized parameters on ``module`` and return True, or return
False to keep the 16-bit ``weight``.
"""

from __future__ import annotations


def scheme_for(spec, settings):
    """The quantization scheme of ``spec`` (its ``quantization_config``) under ``settings``, or None."""
    return None
