"""Running servers: groups of servers across devices, restarts, and Ray clusters.

    supervisor.py   ``serve --device cuda:0,cuda:1``: one server per device under one name
    processes.py    starting, waiting for and stopping server processes
    ray.py          one decoder per Ray node, found by that node's replicas

May import: ``server`` (its stop signals), ``client``, ``protocol``, ``codecs`` and ``errors``;
never the tools layer. A supervisor process imports no torch.
"""
