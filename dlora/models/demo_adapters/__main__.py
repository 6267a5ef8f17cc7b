"""`python -m dlora.models.demo_adapters`: train, evaluate and save the demo adapters."""

import sys

from dlora.models.demo_adapters.run import main

sys.exit(main())
