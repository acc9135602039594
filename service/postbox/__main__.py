from postbox.cli.root import main

main()
