"""The algorithms, free of I/O: effects out, replies in (see ``engine.py``)."""
