import sys

from nanohlat.bench.bench import main
from nanohlat.system.cli import command

sys.argv[0] = "python -m nanohlat.bench"   # argparse's usage line names the command, not __main__.py
sys.exit(command(main))   # an exercise stub reached: one line naming it
