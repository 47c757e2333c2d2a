"""The metalguard region controller, and the CLI's composition root."""

__version__ = "0.1.0"
