import sys

from nanohlat.serving.harness import main

sys.exit(main())
