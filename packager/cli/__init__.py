"""The ``edgeq`` command: thin argv adapters over the library, one file per verb."""
