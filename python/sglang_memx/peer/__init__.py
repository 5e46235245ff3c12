"""The peer KV tier inside the server (``--memx-peer-kv``): ``server`` wires
``memory_ext.peer`` (donor, borrower tier, KV spill / load) into one scheduler; ``checks``
refuses the flag combinations it cannot serve. See docs/peer-kv.md."""
