from pagedrun.cli.app import main

main()
