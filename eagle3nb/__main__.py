import sys

from eagle3nb.cli import main

sys.exit(main())
