"""A cluster on one machine: memory servers and workers on separate network hosts
(network namespaces on a bridge, links capped with ``tc``), and the experiments run on
it: bandwidth scaling, striped vs layered sharding, memory-box aggregation vs gloo
all-reduce, and a memory server's link going down.

    .venv/bin/python -m bench.cluster            # make bench-cluster
    .venv/bin/python -m bench.cluster --cleanup  # remove what a killed run left behind

Modules: :mod:`.netns` (namespaces, links, caps), :mod:`.testbed` (hosts, daemons,
workers, teardown), :mod:`.worker` (what runs on a worker host), :mod:`.experiments`,
:mod:`.report` (tables, plots), :mod:`.cpuload`.
"""
