"""The health score: signals, the rule pipeline's engine, the scoring config."""
