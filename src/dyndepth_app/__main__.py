import sys

from dyndepth_app.cli import main

sys.exit(main())
