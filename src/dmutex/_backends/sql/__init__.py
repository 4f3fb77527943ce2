"""What the SQL stores share: engine lending, the read-write state codec and store.

- ``engines.py``: SQLAlchemy engines lending their driver's connections;
- ``rwstate.py``: a read-write lock's state as the JSON its row holds;
- ``readwrite.py``: the read-write store over one dialect's statements.
"""
