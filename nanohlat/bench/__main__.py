import sys

from nanohlat.tools.bench import main

sys.exit(main())
