"""prefix."""
