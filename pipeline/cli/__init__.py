"""The command line's settings (typed schema and rules), its assembly of a pipeline, its result files."""
