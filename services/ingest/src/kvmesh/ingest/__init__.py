"""kvmesh ingest service."""
