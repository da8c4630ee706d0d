from rltool.cli import main

if __name__ == "__main__":  # torch_dist saving spawns processes that re-import __main__
    main()
