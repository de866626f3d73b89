from pagedrun.cli import main

main()
