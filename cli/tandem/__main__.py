from tandem.app import main

main()
