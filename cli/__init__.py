"""The `eagle31-export` command line (installed as the package `eagle31_export.cli`)."""
