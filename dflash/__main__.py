import sys

from .cli import main

sys.exit(main())  # main() ignores a signal landing after it chose its exit code: cli.py
