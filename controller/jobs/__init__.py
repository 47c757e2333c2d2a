"""Training jobs: spec, gang scheduler and state machine (pure), store and manager."""
