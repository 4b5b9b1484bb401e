"""Observability: metrics, console, progress, run reports and stability guards."""
