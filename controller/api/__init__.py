"""The region controller's HTTP API (aiohttp; docs/api.md): one module per resource.

Route prefix                      Module
--------------------------------  -----------------------------------------------------
``/healthz``                      app.py        (make_app: middlewares, the route table)
``/metrics``                      metrics.py    (ingest's registry, the grade counts)
``/v1/openapi.json``              openapi.py    (the OpenAPI 3.1 document; shapes.py: bodies)
``/v1/nodes``, ``/v1/nodes/{n}``  nodes.py      (list, one node, cordon/uncordon/maintenance)
``/v1/nodes/by-uuid/{uuid}``      fleet.py      (a node of any region, by UUID)
``/v1/fleet``                     fleet.py      (every region's summary; federation)
``/v1/events``                    events.py     (SSE stream and history; the stream: sse.py)
``/v1/jobs``                      jobs.py       (submit, list, show, cancel)
``/v1/qos``                       qos.py        (flow-control profiles)
``/v1/images``, ``/v1/instances``,  provision.py  (provisioning: images, instances,
``/v1/volumes``, ``/v1/provision``                tenant volumes, provisioned nodes)
``/v1/leader``                    leader.py     (who leads the region; HA)
``/``, ``/ui/``                   dashboard.py  (the dashboard's static files, static/)

Shared by every route: auth.py (bearer tokens, the read/admin checks) and errors.py
(ApiError, the JSON error middleware, query-parameter checks).  server.py serves the app
from ``metalguard controller run`` (the ``[http]`` section: listen, tokens, TLS).
"""
