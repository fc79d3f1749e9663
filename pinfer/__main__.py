from pinfer.cli.main import main

main()
