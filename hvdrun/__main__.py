from hvdrun.command import main

main()
