"""The HTTP API: the app and its routes, one module per resource, SSE, the dashboard."""
