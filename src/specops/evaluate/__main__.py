import sys

from .specdec import main

sys.exit(main())
