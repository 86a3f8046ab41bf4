"""Benchmarks: ``kvmesh bench trace`` (routing policies on a Mooncake trace) and micro-benchmarks."""
