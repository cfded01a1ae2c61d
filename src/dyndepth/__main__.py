import sys

from dyndepth._cli import main

sys.exit(main())
