"""The metalguard region controller (docs/controller.md)."""
