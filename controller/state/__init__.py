"""The region's state in JetStream: the node store (KV), streams and buckets."""
