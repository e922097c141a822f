import sys

from eagle3nb.stage_cli import main

sys.exit(main("06_select"))
