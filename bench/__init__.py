"""Benchmarks of quantplug against its peers (run ``python -m bench``; see bench/README.md)."""
