"""mmpack dataloader."""
