"""Benchmarks behind `mesh bench ...`: each prints a table and can write JSON."""
