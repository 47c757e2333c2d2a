"""The fleet twin: a simulated fleet driven by the real scheduler and health code."""
