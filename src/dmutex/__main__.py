"""``python -m dmutex``: the ``dmutex`` command, for where the console script is not on PATH."""

from dmutex._cli import main

raise SystemExit(main())
