"""Mesh on a Ray cluster (`mesh serve --ray`): node agents as Ray actors, membership, autoscaling.
docs/cluster.md."""
