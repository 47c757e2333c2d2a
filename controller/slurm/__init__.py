"""The Slurm bridge (docs/slurm.md): metalguard's decisions drive a Slurm cluster."""
