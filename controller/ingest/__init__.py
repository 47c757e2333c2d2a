"""Durable JetStream consumers feeding the region controller, in per-node order."""
