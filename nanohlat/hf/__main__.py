import sys

from nanohlat.serving.hf import main

sys.exit(main())   # its errors, an exercise stub reached: one line each (system/cli.py)
