import sys

from bumblebot.app.cli import main

sys.exit(main())
