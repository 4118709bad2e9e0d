"""mmpack offline_packing."""
