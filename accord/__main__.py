"""`python -m accord ...` is the `accord` command."""
import sys

from accord.cli import main

sys.exit(main())
