import sys

from nanohlat.bench.bench import main

sys.argv[0] = "python -m nanohlat.bench"   # argparse's usage line names the command, not __main__.py
sys.exit(main())   # its errors, an exercise stub reached: one line each (system/cli.py)
