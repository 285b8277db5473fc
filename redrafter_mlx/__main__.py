from redrafter_mlx.cli import entry

entry()
