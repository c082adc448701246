import sys

from pipetune.cli.main import main

sys.exit(main())
