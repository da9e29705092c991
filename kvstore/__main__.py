import sys

from kvstore.app.cli import main

sys.exit(main())
