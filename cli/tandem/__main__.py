from tandem.commands.app import main

main()
