import sys

from zeropipe.cli.main import main

sys.exit(main())
