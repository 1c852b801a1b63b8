"""Benchmark helpers for the compile service."""
