"""The ``oomguard`` command line: argument parsing, one error policy, one logging setup."""
