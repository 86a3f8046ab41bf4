"""Simulated vLLM engines: block pool with prefix caching, ZMQ publisher with replay, trace replay."""
