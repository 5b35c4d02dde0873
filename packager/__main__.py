from edgeq.cli.main import entry

entry()
