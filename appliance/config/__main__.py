"""``python -m appliance.config --markdown`` writes docs/configuration.md."""

import sys

from appliance.config.markdown import config_markdown

if sys.argv[1:] == ["--markdown"]:
    sys.stdout.write(config_markdown())
else:
    sys.exit("usage: python -m appliance.config --markdown")
