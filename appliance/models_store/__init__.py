"""The model store: ``models pull`` (a Hugging Face repository, with the client's progress
and resume, checksums, the disk checked first), ``models list`` and ``models remove``.

- :mod:`appliance.models_store.store`: where the folders are, what is in them, who uses them;
- :mod:`appliance.models_store.pull`: the download and its rules;
- :mod:`appliance.models_store.cli`: the commands.
"""
