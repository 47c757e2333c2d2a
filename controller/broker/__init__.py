"""nats-server child processes: one server (the demo, tests, benches) and a cluster of
them on loopback (the sharded region's test harness, docs/scaling.md)."""
