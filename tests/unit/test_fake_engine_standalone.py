"""The fake engine runs as a lone script with the files copied beside it, as the systemd
container test installs it (/srv/fake_engine.py, no repository on sys.path): a helper
module it imports but that is not copied fails every engine start there."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.fakes.engine_proc import FAKE_ENGINE_PATH, FAKE_ENGINE_SIBLINGS


def test_the_fake_engine_and_its_siblings_run_alone(tmp_path: Path) -> None:
    for path in (FAKE_ENGINE_PATH, *FAKE_ENGINE_SIBLINGS):
        shutil.copy2(path, tmp_path / Path(path).name)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, str(tmp_path / "fake_engine.py"), "--help"],
        cwd="/",
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "--uds" in done.stdout
