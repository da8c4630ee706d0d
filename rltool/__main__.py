from rltool.cli import main

main()
