from hvdrun import main

main()
