import sys

from nanohlat.serving.hf import main

sys.exit(main())
