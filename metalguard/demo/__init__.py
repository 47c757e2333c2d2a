"""`metalguard demo`: NATS, a controller per region and a simulated fleet in one process.

It composes the agent and the controller; neither imports it."""
