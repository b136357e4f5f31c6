"""`python -m nanohlat.classroom`: the kit's command line (nanohlat/classroom/kit.py)."""
import sys

from nanohlat.classroom.kit import main

sys.exit(main())
