"""metalguard: node agents, region controllers and NATS in between.

The import namespace (docs/architecture.md): ``metalguard.proto`` (the wire contract),
``metalguard.agent`` (the node agent), ``metalguard.controller`` (the region controller),
``metalguard.demo`` (the demo and the simulated fleet), ``metalguard.checkpoint`` (the
client library training scripts import) and ``metalguard.cli`` (the ``metalguard``
command, the composition root).
"""

__version__ = "0.1.0"
