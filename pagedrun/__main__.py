from pagedrun.cli.app.app import main

main()
