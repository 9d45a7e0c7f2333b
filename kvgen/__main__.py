import sys

from kvgen.tools.cli import main

sys.exit(main())
