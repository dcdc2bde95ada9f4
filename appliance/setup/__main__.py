"""``python -m appliance.setup``: the same as ``llm-appliance setup``."""

import sys

from appliance.setup import main

sys.exit(main())
