from hvdrun.cli import main

main()
