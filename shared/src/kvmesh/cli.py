"""The `kvmesh` command (placeholder)."""

def main() -> None:
    """Run the kvmesh command line."""
