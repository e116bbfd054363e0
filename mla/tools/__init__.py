"""What a person runs: the ``mla`` command line, the serving demo (one process or decode
context parallel) and the reference math the demo and the kit check against."""
