"""Controller shards: a region's clusters split into named groups, each owned by one
process at a time through a lease in ``<P>_LEASES`` (docs/scaling.md)."""
