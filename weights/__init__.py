"""The shipped drafters (the repository's weights/ folder, installed as redrafter_mlx.weights)."""
