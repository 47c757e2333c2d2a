"""Flow control on the node: profile -> plan (pure), backends (tc, dcb, mlx5), reconciler."""
