import sys

from dyndepth._app.cli import main

sys.exit(main())
