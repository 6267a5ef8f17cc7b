import sys

from dlora.gpucheck.cli import main

sys.exit(main())
