"""`python -m prfaas_sim`."""

import sys

from prfaas_sim.cli import main

sys.exit(main())
