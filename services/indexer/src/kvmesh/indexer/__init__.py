"""kvmesh indexer service."""
