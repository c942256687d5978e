"""Scripts run from a checkout, not installed with the package."""
