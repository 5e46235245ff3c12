"""Remappable weights inside SGLang (``--memx-weights``): the decoder layers move into the
elastic KV's pool after the KV pool is built (``attach``), every layer's forward runs through
the layer pipeline (``WeightsState``), and once per scheduler iteration the Oneiros
controller decides from KV pressure whether to release or restore a layer (``remap``)."""
