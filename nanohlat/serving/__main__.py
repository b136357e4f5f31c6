"""`python -m nanohlat.serving`: speculative decoding (nanohlat/serving/server.py)."""
import sys

from nanohlat.serving.server import main
from nanohlat.system.cli import command

sys.argv[0] = "python -m nanohlat.serving"   # argparse's usage line names the command, not __main__.py
sys.exit(command(main))   # an exercise stub reached: one line naming it
