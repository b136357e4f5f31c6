import sys

from nanohlat.serving.hf import main
from nanohlat.system.cli import command

sys.exit(command(main))   # an exercise stub reached: one line naming it
