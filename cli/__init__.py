"""mha_rosetta.cli: the ``mha-rosetta`` command line (see `cli.main`)."""
