"""The driver: validation before Ray, sizing the cluster, starting Ray Train, resuming, the spot
watcher and the evaluate command."""
