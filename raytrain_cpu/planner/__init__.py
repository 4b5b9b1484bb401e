"""Memory and step planning: what a configuration needs per rank, and what fits on a cluster."""
