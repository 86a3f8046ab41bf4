"""Harness for running a whole kvmesh on one machine: a private ``nats-server`` and child-process helpers.

Used by `kvmesh up`, the benchmarks and the tests; not part of the library wheel.
"""
