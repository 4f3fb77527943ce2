"""The algorithms, free of I/O: effects out, replies in (see ``engine.py``).

``abc.py`` holds the store protocol the engine is written against; nothing in
this package imports from the rooms above it (``_backends``, ``_runtime``,
``_faces``, ``_cli``).
"""
