"""``python -m mmgrpo`` (what ``accelerate launch -m mmgrpo ...`` runs): the ``mmgrpo`` command."""

import sys

from mmgrpo.cli import main

sys.exit(main())
