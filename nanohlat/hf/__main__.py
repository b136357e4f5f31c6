import sys

from nanohlat.serving.hf import main
from nanohlat.run.launch import command

sys.exit(command(main))   # an exercise stub reached: one line naming it
