"""Engine-independent machinery of the simulator (events, engine, links, KV
cache, requests, roofline, hardware and model tables, workloads, statistics,
the scheduler/hook contracts and the stock baseline scheduler). Import the
submodules directly; this package imports nothing."""
