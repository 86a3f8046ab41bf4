"""kvmesh router service."""
