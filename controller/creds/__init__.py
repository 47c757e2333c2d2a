"""Per-node NATS users: their permissions (pure) and the credentials directory."""
