"""``python -m mmgrpo`` (what ``accelerate launch -m mmgrpo ...`` runs): the ``mmgrpo`` command."""

import sys

from mmgrpo.cli.app import main

sys.exit(main())
