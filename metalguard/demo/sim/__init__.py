"""A simulated fleet: generated sysfs trees, hardware faults written into them, and many
real agents in one process publishing over NATS (docs/simulation.md)."""
