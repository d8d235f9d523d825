from carryover.cli import main

main()
