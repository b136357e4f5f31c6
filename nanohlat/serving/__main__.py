"""`python -m nanohlat.serving`: speculative decoding (nanohlat/serving/server.py)."""
import sys

from nanohlat.serving.server import main

sys.argv[0] = "python -m nanohlat.serving"   # argparse's usage line names the command, not __main__.py
sys.exit(main())   # its errors, an exercise stub reached: one line each (system/cli.py)
