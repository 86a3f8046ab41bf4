"""Deployment tools: NATS credentials and certificates for a secured cluster (`kvmesh gen-creds`) and the
compose deployment run as local processes (`kvmesh cluster`)."""
