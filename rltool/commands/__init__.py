"""Thin click commands: parse options, resolve the stage config, call the library.

Shared helpers live in `rltool.commands.common`.
"""
