import signal
import sys

from .cli import main

rc = main()
# The command has said how it ended and chosen its exit code: a signal during the teardown
# left (telemetry's drain, which has its deadline, and the interpreter's exit, which puts
# the default handlers back) must not turn that code into death by signal (-15).
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
sys.exit(rc)
