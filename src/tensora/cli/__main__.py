from tensora.cli import main

main()
