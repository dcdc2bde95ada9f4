"""`llm-appliance doctor`: one command that says whether this box can run the appliance,
and what to do where it cannot. Run it before and after provisioning; it is the first
thing support asks for.

Each check is a small function returning a :class:`Result` (✓ ok, ✗ fail with a fix,
– not applicable with the reason) from inputs a test can fake; the runner gathers the
machine's facts once (:class:`Probes`) and prints a table, or JSON with ``--json``.
Exit 0 when nothing is ✗, 1 when something is, 2 when the config itself is invalid
(as for every command).

::

    result.py   Result, Account (whose files these should be)
    gpu.py      NVIDIA driver, NVML, each GPU (memory, heat, power limit, persistence,
                other processes holding its memory)
    engine.py   engine venv imports vLLM (the right build), model present, readable and
                within the GPU budget, engine sockets' directory or ports
    host.py     state dir and keys file modes, free disk, the systemd unit, /readyz
    state_files.py  whether usage.json, audit.log, keys.json can be written (the daemon's
                own account in /readyz, else the disk's free space and modes)
    runner.py   the order of the checks, the table and the JSON, the subcommand

The doctor only reads: it changes no file, starts no engine and sends no key.
"""

from appliance.doctor.result import Account, Result
from appliance.doctor.runner import Probes, Report, add_parser, cmd_doctor, run_checks

__all__ = ["Account", "Probes", "Report", "Result", "add_parser", "cmd_doctor", "run_checks"]
