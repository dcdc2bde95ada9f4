import sys

from tests.gpu_check.main import main

sys.exit(main())
