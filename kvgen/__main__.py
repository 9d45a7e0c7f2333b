import sys

from kvgen.cli import main

sys.exit(main())
