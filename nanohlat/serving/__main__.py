"""`python -m nanohlat.serving`: speculative decoding (nanohlat/serving/server.py)."""
import sys

from nanohlat.serving.server import main

sys.exit(main())
