from redrafter_mlx.cli import main

main()
