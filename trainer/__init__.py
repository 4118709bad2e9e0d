"""mmpack trainer."""
