import sys

from torchplace.cli import main

sys.exit(main())
