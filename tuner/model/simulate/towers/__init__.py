"""Vision towers, one module per tower family; multimodal plugins compose them through
:class:`tuner.model.simulate.vision.VisionTower` (``kind="pixtral"`` or a tower module itself).

A tower module holds:

- ``KIND`` (its name) and ``QUANTIZABLE`` (whether vLLM hands the checkpoint's ``quant_config``
  to the tower, so a quantization scheme may take its quantizable linears);
- ``geometry(vc, top) -> Geometry``: the tower's sizes from the ``vision_config`` dict ``vc`` and
  the top-level config ``top``, defaults resolved (:class:`~tuner.model.simulate.towers.base.Geometry`);
- ``params(vc, top, g) -> list``: the tower's and projector's parameters and buffers as vLLM
  allocates them (un-sharded shapes, entries as in :mod:`tuner.model.simulate.towers.base`);
- optionally ``MODALITIES`` (default ``("image",)``): the modalities the tower serves; vLLM (0.15+)
  does not build it when all are limited to 0 (:func:`tuner.model.simulate.vision.drop_unbuilt_towers`);
- optionally ``max_tokens_per_item(vc, top, g) -> (T, crops, patches_per_crop)`` and
  ``encode(tower, items, T, crops, patches)``, the V1 encoder profile pass replayed on the
  :class:`~tuner.model.simulate.vision.VisionTower` ``tower`` (its ``empty``/``pixels`` allocate,
  ``geom``/``vc``/``top``/``tp``/``dtype``/``engine_version`` describe it); without them the
  tower contributes weights only.

Built-in towers: :mod:`.pixtral`, :mod:`.siglip`, :mod:`.llama4`, :mod:`.moonvit`,
:mod:`.qwen3_5`, :mod:`.gemma4`.
"""
