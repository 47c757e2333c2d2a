"""The pure decision core: scoring and rules, lifecycle, rail, decide, topology.

Nothing here does I/O: no nats, aiohttp, asyncio, subprocess or socket (import-linter
enforces it, pyproject.toml)."""
