"""lang package."""
