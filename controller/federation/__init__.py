"""Regions together: the fleet view, job forwarding (pure), the service on NATS."""
