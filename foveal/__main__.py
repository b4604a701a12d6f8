import sys

from foveal.entrypoints.cli import main

sys.exit(main())
