"""grammar package."""
