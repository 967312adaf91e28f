import sys

from bumblebot.cli import main

sys.exit(main())
