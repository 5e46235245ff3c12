"""The papers' mechanisms as simulator schedulers and hooks, one module per
paper (``oneiros``, ``select_n``, ``ellm``, ``fineserve``, ``swiftcache``),
plus the X1 node arbiter glue (``arbiter``) and generic layer streaming
(``layer_streaming``). Each mechanism object has ``stats()`` in the common
shape of ``core.stats``. Kinds are listed in ``benchmark/sim/registry.py``;
this package imports nothing."""
